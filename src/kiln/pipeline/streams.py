"""Many streams through one pipeline: each stage's calls from every stream pooled into batches.

Each stream runs the user's function in a thread of its own, so glue (Python, or numpy and
OpenCV, which release the GIL) of one stream overlaps the engines' work for others. Each model
sits behind a `kiln.runtime.batcher.Batcher`: the calls streams make at about the same time
run as one batch where their shapes allow (the session's `run_batch` groups requests of equal
shape, and pads within a bucket), so a recogniser's crops from sixteen images run together
instead of one image's at a time — except for a stage whose batch the compile measured no
faster per sample (merging.py), whose calls run apart, side by side. Queues are bounded by
the number of streams: a stream holds at most one call per stage at once, because its
function waits for the answer.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kiln.pipeline.function import PipelineFunction
from kiln.pipeline.recording import call_function
from kiln.runtime.batcher import Batcher, BatchRecord, Feeds

# How long a stage waits for other streams' calls to join the first one: none by default, as
# Triton's dynamic batcher — the calls that queue while a batch runs form the next one, and a
# wait would be added to every call of a model that runs in a fraction of it.
MAX_DELAY_S = 0.0


@dataclass
class StageStats:
    """One stage's calls over a run: how many, in how many executions, and where their time
    went (seconds summed over calls: waiting in the queue, the batch's run)."""

    calls: int = 0
    executions: int = 0
    samples: int = 0
    queue_s: float = 0.0
    compute_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def observe(self, record: BatchRecord) -> None:
        with self._lock:
            self.calls += record.requests
            self.executions += 1
            self.samples += record.samples
            self.queue_s += sum(record.queue_times)
            self.compute_s += record.run_time

    def to_json(self) -> dict[str, float | int]:
        return {
            "calls": self.calls,
            "executions": self.executions,
            "mean_batch": round(self.calls / self.executions, 3) if self.executions else 0.0,
            "queue_ms_per_call": round(1e3 * self.queue_s / self.calls, 4) if self.calls else 0.0,
            "compute_ms": round(1e3 * self.compute_s, 3),
        }


def _run_batch(session: Any):
    """The session's `run_batch` where it has one (a kiln session merges what it safely can),
    else each request run alone (a plain onnxruntime session)."""
    if hasattr(session, "run_batch"):
        return session.run_batch
    return lambda requests: [session.run(None, feeds) for feeds in requests]


def merge_group(feeds: Feeds) -> tuple:
    """Which calls may share a run: those equal in every input's dtype and shape past the
    batch axis (the session concatenates those; others would run one after another)."""
    return tuple((n, a.dtype.str, a.shape[1:]) for n, a in sorted(feeds.items()))


_CALLS = itertools.count()


def alone(_feeds: Feeds) -> int:
    """A group of its own for every call: a stage whose batches run no faster per sample
    (merging.py) runs each call apart, several side by side."""
    return next(_CALLS)


class Stage:
    """One model shared by every stream: its session, its batcher and its statistics."""

    def __init__(
        self, name: str, session: Any, streams: int, max_delay: float = MAX_DELAY_S,
        merge: bool = True,
    ):  # fmt: skip
        self.name, self.session = name, session
        self.stats = StageStats()
        self.outputs = [o.name for o in session.get_outputs()]
        self.batcher = Batcher(
            _run_batch(session),
            max_batch=max(streams * 64, 16),  # a crop-heavy call is many samples at once
            max_delay=max_delay if streams > 1 else 0.0,
            max_queue=max(streams, 1),
            observe=self.stats.observe,
            # Batches side by side, one a core: calls of unequal shapes (a detector's images
            # of other sizes) do not merge, and one worker would run them one at a time.
            workers=max(1, min(streams, os.cpu_count() or 1)),
            group=merge_group if merge else alone,
        )
        self.batcher.start()

    def close(self) -> None:
        self.batcher.close()


class PooledModel:
    """A stream's handle on a stage, as an ONNX Runtime session: `run` hands the call to the
    stage's batcher and waits for its share of the batch."""

    def __init__(self, stage: Stage):
        self.stage = stage

    def run(self, output_names: list[str] | None, feeds: Feeds, *args: Any) -> list[np.ndarray]:
        outputs = self.stage.batcher.submit(dict(feeds)).result()
        if output_names is None:
            return outputs
        index = {name: i for i, name in enumerate(self.stage.outputs)}
        return [outputs[index[name]] for name in output_names]

    @property
    def name(self) -> str:
        return self.stage.name

    def __getattr__(self, name: str) -> Any:  # get_inputs, get_outputs, ... of the session
        return getattr(self.stage.session, name)


@dataclass
class StreamsRun:
    """What `run_streams` measured: each input's result and end-to-end seconds, in input order."""

    results: list[Any]
    seconds: list[float]
    wall_s: float
    stages: dict[str, dict[str, float | int]]


def run_streams(
    function: PipelineFunction,
    sessions: Mapping[str, Any],
    inputs: Iterable[Any],
    streams: int,
    max_delay: float = MAX_DELAY_S,
    apart: Collection[str] = (),
) -> StreamsRun:
    """`function` over `inputs` on `streams` threads, each model's calls pooled across them.
    Each stream takes the next input when its last one is answered (MLPerf's MultiStream
    rule); results come back in input order. The first failure ends the run (KilnError).
    `apart`: the stages whose calls never share a run (merging.py)."""
    stages = {name: Stage(name, s, streams, max_delay, merge=name not in apart)
              for name, s in sessions.items()}  # fmt: skip
    models = {name: PooledModel(stage) for name, stage in stages.items()}
    items = list(enumerate(inputs))
    results: list[Any] = [None] * len(items)
    seconds = [0.0] * len(items)
    feed = iter(items)
    lock, failed = threading.Lock(), threading.Event()

    def stream() -> None:
        for index, value in _take(feed, lock, failed):
            start = time.perf_counter()
            try:
                results[index] = call_function(function, value, index, models)
            except BaseException:
                failed.set()  # the other streams take no further input
                raise
            seconds[index] = time.perf_counter() - start

    try:
        wall = on_streams(stream, max(1, streams), "kiln-stream")
    finally:
        for stage in stages.values():
            stage.close()
    return StreamsRun(results, seconds, wall, {n: s.stats.to_json() for n, s in stages.items()})


def on_streams(stream: Callable[[], None], count: int, prefix: str) -> float:
    """`stream` on `count` threads at once; the seconds from when every thread is up (their
    start is not the work's time) until the last is done. A stream's failure is raised."""
    ready = threading.Barrier(count + 1)

    def started() -> None:
        ready.wait()
        stream()

    with ThreadPoolExecutor(count, thread_name_prefix=prefix) as pool:
        running = [pool.submit(started) for _ in range(count)]
        ready.wait()
        begin = time.perf_counter()
        for done in running:
            done.result()
        return time.perf_counter() - begin


def _take(
    items: Iterator[tuple[int, Any]], lock: threading.Lock, failed: threading.Event
) -> Iterator[tuple[int, Any]]:
    while not failed.is_set():
        with lock:
            item = next(items, None)
        if item is None:
            return
        yield item
