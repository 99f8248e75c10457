"""Where a pipeline's query time goes on N streams: glue, queueing and compute per stage.

The artifact runs over the data as `kiln.Pipeline.map` runs it (streams.py: each stage behind a
batcher pooling every stream's calls), with two thin wrappers that only read the clock:
- each stage's session, as its batcher calls it: when a batch's execution started and ended,
  kept per request (by the identity of the request's arrays, alive until the caller has its
  answer);
- each stream's handle on a stage, as the function calls it: when the call was submitted and
  when its answer came back.
A query's time then splits exactly into
- compute: its calls' batch executions (a call shares its batch's whole run: it waited for it);
- queue: its calls' time before their batch started and after it ended (the hand-off back);
- glue: the rest, the function's own Python, numpy and OpenCV between the calls.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.errors import KilnError
from kiln.pipeline.data import load_data
from kiln.pipeline.function import PipelineFunction
from kiln.pipeline.runtime import Pipeline
from kiln.pipeline.streams import run_streams

Say = Callable[[str], None]
# A finding is made where a part takes at least this share of the query time.
QUEUE_SHARE, COMPUTE_SHARE, GLUE_SHARE = 0.2, 0.4, 0.4
LOW_BATCH = 1.5  # a mean batch below this pooled next to nothing


@dataclass
class CallSpan:
    """One model call of a query: submitted, its batch started and ended, its answer back."""

    stage: str
    submit: float
    start: float
    end: float
    returned: float

    @property
    def queue(self) -> float:
        return (self.start - self.submit) + (self.returned - self.end)

    @property
    def compute(self) -> float:
        return self.end - self.start


@dataclass
class QuerySpan:
    """One input answered by one stream: its time and its model calls, in order."""

    stream: int
    start: float
    end: float = 0.0
    calls: list[CallSpan] = field(default_factory=list)

    @property
    def glue(self) -> float:
        return (self.end - self.start) - sum(c.returned - c.submit for c in self.calls)


def _key(feeds: Mapping[str, Any]) -> tuple[int, ...]:
    return tuple(id(value) for value in feeds.values())


class TimedSession:
    """A stage's session as its batcher calls it: runs as the session does, and keeps each
    request's batch start and end until the stream's handle takes them."""

    def __init__(self, session: Any) -> None:
        self.session = session
        batch = getattr(session, "run_batch", None)
        self._batch = batch or (lambda requests: [session.run(None, f) for f in requests])
        self._lock = threading.Lock()
        self._done: dict[tuple[int, ...], tuple[float, float]] = {}

    def run_batch(self, requests: list[dict[str, Any]]) -> list:
        start = time.perf_counter()
        try:
            return self._batch(requests)
        finally:  # kept before the batcher hands the answers back
            end = time.perf_counter()
            with self._lock:
                for feeds in requests:
                    self._done[_key(feeds)] = (start, end)

    def take(self, feeds: Mapping[str, Any]) -> tuple[float, float] | None:
        with self._lock:
            return self._done.pop(_key(feeds), None)

    def __getattr__(self, name: str) -> Any:  # get_inputs, get_outputs, ... of the session
        return getattr(self.session, name)


class TimedHandle:
    """A stream's handle on a stage as the function calls it: the pooled call, timed."""

    def __init__(self, model: Any, timer: TimedSession, query: QuerySpan) -> None:
        self.model, self.timer, self.query = model, timer, query

    def run(self, output_names: list[str] | None, feeds: Mapping[str, Any], *args: Any) -> Any:
        submit = time.perf_counter()
        outputs = self.model.run(output_names, feeds, *args)
        returned = time.perf_counter()
        start, end = self.timer.take(feeds) or (submit, returned)
        self.query.calls.append(CallSpan(self.model.name, submit, start, end, returned))
        return outputs

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def timed_run(
    function: PipelineFunction, sessions: Mapping[str, Any], inputs: Sequence[Any],
    streams: int, max_delay: float, apart: Collection[str] = (),
) -> tuple[list[QuerySpan], dict[str, dict[str, Any]], float]:  # fmt: skip
    """`run_streams` with every query and pooled call timed: the queries in the order they
    started, the stages' statistics and the wall time."""
    timers = {name: TimedSession(s) for name, s in sessions.items()}
    queries: list[QuerySpan] = []
    numbers: dict[int, int] = {}  # stream thread → stream number, in order of first query
    lock = threading.Lock()

    def timed(value: Any, **models: Any) -> Any:
        with lock:
            stream = numbers.setdefault(threading.get_ident(), len(numbers))
            query = QuerySpan(stream, time.perf_counter())
            queries.append(query)
        handles = {n: TimedHandle(m, timers[n], query) for n, m in models.items()}
        try:
            return function(value, **handles)
        finally:
            query.end = time.perf_counter()

    run = run_streams(timed, timers, inputs, streams, max_delay, apart)
    return queries, run.stages, run.wall_s


def profile_pipeline(
    artifact: str | os.PathLike,
    data: str | Sequence[Any],
    streams: int | None = None,
    trace: str | os.PathLike | None = None,
    max_delay_ms: float | None = None,
    say: Say | None = None,
) -> dict[str, Any]:
    """The split of each query into glue, queueing and compute per stage, each stage's calls
    and batches, and findings naming the stage and the setting; a Perfetto trace at `trace`.
    `streams` defaults to the count the artifact was compiled for."""
    say = say or (lambda line: None)
    inputs = load_data(data)
    options = {} if max_delay_ms is None else {"max_delay_ms": max_delay_ms}
    with Pipeline(artifact, **options) as pipe:
        assert pipe.manifest is not None  # Pipeline(artifact) read it
        n = streams if streams is not None else int(pipe.manifest.get("streams", 1))
        if n < 1:
            raise KilnError(f"--streams {n}: give 1 or more.")
        say("warming the stages")
        pipe(inputs[0])  # first runs build what engines build once
        say(f"{len(inputs)} queries on {n} streams")
        queries, stages, wall = timed_run(
            pipe.function, pipe.sessions, inputs, n, pipe.max_delay, pipe.apart
        )
        delay_ms = 1e3 * pipe.max_delay if n > 1 else 0.0
        precisions = {name: s["precision"] for name, s in pipe.manifest["stages"].items()}
    result = summarize(queries, stages, wall, n, delay_ms, precisions, pipe.apart)
    result["artifact"] = str(artifact)
    if trace is not None:
        say(f"writing {trace}")
        try:
            events = trace_events(queries, list(stages), n)
            Path(trace).write_text(json.dumps(events) + "\n")
        except OSError as exc:
            why = exc.strerror or exc
            raise KilnError(f"--trace {trace}: could not write it ({why}).") from None
    return result


def _figures(values: list[float], whole: float) -> dict[str, float]:
    total = sum(values)
    return {
        "median_ms": round(1e3 * statistics.median(values), 4),
        "total_ms": round(1e3 * total, 4),
        "share": round(total / whole, 4) if whole > 0 else 0.0,
    }


def summarize(
    queries: list[QuerySpan], stages: dict[str, dict[str, Any]], wall: float, streams: int,
    delay_ms: float, precisions: Mapping[str, str], apart: Collection[str] = (),
) -> dict[str, Any]:  # fmt: skip
    """The run as a JSON-ready dict: per query medians and totals of each part, per stage its
    batching, and the findings."""
    times = [q.end - q.start for q in queries]
    whole = sum(times)

    def per_query(stage: str, part: str) -> list[float]:
        return [sum(getattr(c, part) for c in q.calls if c.stage == stage) for q in queries]

    split = {
        "glue": _figures([q.glue for q in queries], whole),
        "stages": {
            name: {part: _figures(per_query(name, part), whole) for part in ("queue", "compute")}
            for name in stages
        },
    }
    ordered = sorted(times)
    result = {
        "streams": streams,
        "max_delay_ms": delay_ms,
        "queries": len(queries),
        "queries_per_s": round(len(queries) / wall, 3) if wall > 0 else 0.0,
        "query": {
            **_figures(times, whole),
            "p99_ms": round(1e3 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 4),
        },
        "split": split,
        "stages": {
            n: {**s, "precision": precisions.get(n, ""), "merges": n not in apart}
            for n, s in stages.items()
        },  # fmt: skip
    }
    result["findings"] = findings(result)
    return result


def findings(result: dict[str, Any]) -> list[str]:
    """What the split says to change, each naming the stage and the setting."""
    streams, delay = result["streams"], result["max_delay_ms"]
    found = []
    for name, parts in result["split"]["stages"].items():
        stage = result["stages"][name]
        queued, computed = parts["queue"]["share"], parts["compute"]["share"]
        batch = stage["mean_batch"]
        waited_ms = parts["queue"]["total_ms"] / max(stage["calls"], 1)
        # Waiting for company: a batch hardly larger than one call, or a wait about the
        # batcher's delay; else the stage is busy and the streams wait for it.
        # A stage whose calls run apart (a batch measured no faster) never waits for company.
        merges = stage.get("merges", True)
        company = streams > 1 and merges and (batch < LOW_BATCH or waited_ms <= 1.5 * delay)
        if queued >= QUEUE_SHARE and company:
            found.append(
                f"stage {name}: {queued:.0%} of query time queued ({waited_ms:.2f} ms a call) "
                f"with mean batch {batch:.1f} at {streams} streams → fewer streams"
                + (
                    f" or a shorter max delay (now {delay:g} ms: kiln.Pipeline(..., "
                    "max_delay_ms=...))"
                    if delay > 0
                    else ""
                )
            )
        elif queued >= QUEUE_SHARE:
            found.append(
                f"stage {name}: {queued:.0%} of query time queued ({waited_ms:.2f} ms a call) "
                + (
                    f"with mean batch {batch:.1f}"
                    if merges
                    else "with its calls run apart (a batch measured no faster)"
                )
                + f" at {streams} streams: the streams wait for it → a faster choice for it "
                "(kiln optimize --precision auto, a metric that allows it) or fewer streams"
            )
        if computed >= COMPUTE_SHARE:
            precision = stage["precision"]
            hint = (
                "try int8 (kiln optimize --precision auto; kiln compare shows what it moves)"
                if precision == "fp32"
                else "kiln profile on its artifact shows its kernels"
            )
            found.append(
                f"stage {name}: {computed:.0%} of query time computing at {precision} → {hint}"
            )
    glue = result["split"]["glue"]["share"]
    if glue >= GLUE_SHARE:
        found.append(
            f"glue is {glue:.0%} of the time → fold array work (kiln.pipeline.ops) or move it "
            "out of the function"
        )
    if not found:
        found.append(f"nothing stands out: glue {glue:.0%}, no stage queues {QUEUE_SHARE:.0%} "
                     f"or computes {COMPUTE_SHARE:.0%} of the query time")  # fmt: skip
    return found


# ---- the trace: Chrome trace-event JSON (Perfetto, chrome://tracing), as kiln.report.trace ----

_PID = 1


def _span(name: str, cat: str, start: float, end: float, tid: int, args: dict) -> dict:
    ts, dur = round(1e6 * start, 3), round(1e6 * max(end - start, 0.0), 3)
    return {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "pid": _PID, "tid": tid,
            "args": args}  # fmt: skip


def _meta(name: str, tid: int, args: dict) -> dict:
    return {"name": name, "ph": "M", "pid": _PID, "tid": tid, "args": args}


def trace_events(queries: list[QuerySpan], stages: list[str], streams: int) -> dict[str, Any]:
    """A track per stream (each query: its glue, and per call its queueing and compute) and a
    track per stage (each batch executed, with how many calls it served)."""
    zero = min((q.start for q in queries), default=0.0)
    stage_tid = {name: streams + 1 + i for i, name in enumerate(stages)}
    events = [_meta("process_name", 0, {"name": "kiln pipeline"})]
    events += [_meta("thread_name", s + 1, {"name": f"stream {s}"}) for s in range(streams)]
    events += [_meta("thread_name", t, {"name": f"stage {n}"}) for n, t in stage_tid.items()]
    batches: dict[tuple[str, float, float], int] = {}
    for index, q in enumerate(queries):
        tid, at = q.stream + 1, q.start - zero
        events.append(_span(f"query {index}", "query", at, q.end - zero, tid, {"query": index}))
        for call in q.calls:
            s, b, e, r = (t - zero for t in (call.submit, call.start, call.end, call.returned))
            events.append(_span("glue", "glue", at, s, tid, {"query": index}))
            events.append(_span(f"queue {call.stage}", "queue", s, b, tid, {"query": index}))
            events.append(_span(f"compute {call.stage}", "compute", b, e, tid, {"query": index}))
            events.append(_span(f"queue {call.stage}", "queue", e, r, tid,
                                {"query": index, "waiting": "for the answer"}))  # fmt: skip
            at = r
            key = (call.stage, call.start, call.end)
            batches[key] = batches.get(key, 0) + 1
        events.append(_span("glue", "glue", at, q.end - zero, tid, {"query": index}))
    for (stage, start, end), calls in sorted(batches.items(), key=lambda item: item[0][1]):
        events.append(_span(f"compute {stage}", "compute", start - zero, end - zero,
                            stage_tid[stage], {"calls": calls}))  # fmt: skip
    return {"traceEvents": events, "displayTimeUnit": "ms"}
