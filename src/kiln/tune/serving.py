"""Throughput as a server delivers it: `clients` closed-loop clients, each sending requests
(one sample each, or the shapes of recorded traffic) and waiting for the answer, through the
dynamic batcher `kiln serve` runs (its max batch and max delay; with traffic, the session's
bucket set) — samples served per second, and the requests' latencies.

Offline throughput (fixed batches on every stream) is the ceiling; served throughput is what
the batcher's knobs and the traffic make of it: a long delay fills batches but holds answers,
a short one runs half-empty batches.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kiln.runtime.batcher import Batcher, samples_of

Feeds = dict[str, np.ndarray]
Run = Callable[[Feeds], list[np.ndarray]]
DELAYS_MS = (0.0, 1.0, 2.0, 5.0, 10.0, 20.0)


@dataclass(frozen=True)
class Served:
    rate: float  # samples per second
    latencies_s: list[float]
    batches: int  # engine runs: fewer than requests when the batcher merged them

    @property
    def p99_ms(self) -> float:
        return float(np.percentile(self.latencies_s, 99)) * 1e3 if self.latencies_s else 0.0


def merged_runner(run: Run) -> Callable[[list[Feeds]], list[list[np.ndarray]]]:
    """The batcher's `run_batch` over one engine: requests concatenated on axis 0 (the batch
    dim), the outputs split back by each request's samples."""

    def run_batch(requests: list[Feeds]) -> list[list[np.ndarray]]:
        if len(requests) == 1:
            return [list(run(requests[0]))]
        merged = {n: np.concatenate([r[n] for r in requests]) for n in requests[0]}
        cuts = np.cumsum([samples_of(r) for r in requests])[:-1]
        outputs = [np.split(np.asarray(o), cuts) for o in run(merged)]
        return [list(parts) for parts in zip(*outputs, strict=True)]

    return run_batch


def serve(
    run_batch: Callable[[list[Feeds]], list[list[np.ndarray]]],
    requests: list[Feeds],
    *,
    clients: int,
    max_batch: int,
    max_delay_ms: float,
    seconds: float,
) -> Served:
    """`clients` threads sending `requests` (each client cycles through them from its own
    offset, one at a time, back to back) for `seconds`; `run_batch` runs what the batcher
    merged: `merged_runner(engine.run)`, or a `kiln.Session`'s `run_batch` (buckets, padding)."""
    batches = [0]

    def counted(merged: list[Feeds]) -> list[list[np.ndarray]]:
        batches[0] += 1
        return run_batch(merged)

    batcher = Batcher(counted, max_batch, max_delay_ms / 1000, max_queue=max(clients, 1) * 2)
    batcher.start()
    latencies: list[float] = []
    done = [0]  # samples answered
    errors: list[Exception] = []
    lock = threading.Lock()
    deadline = time.perf_counter() + seconds

    def client(offset: int) -> None:
        turn = offset
        while time.perf_counter() < deadline and not errors:
            feeds = requests[turn % len(requests)]
            turn += 1
            begin = time.perf_counter()
            try:
                batcher.submit(feeds).result()
            except Exception as exc:  # reported once every client has stopped
                errors.append(exc)
                return
            with lock:
                latencies.append(time.perf_counter() - begin)
                done[0] += samples_of(feeds)

    start = time.perf_counter()
    step = max(1, len(requests) // max(clients, 1))
    threads = [threading.Thread(target=client, args=(i * step,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    batcher.close()
    if errors:
        raise errors[0]
    return Served(done[0] / elapsed, latencies, batches[0])
