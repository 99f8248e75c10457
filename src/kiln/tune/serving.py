"""Throughput as a server delivers it: `clients` closed-loop clients, each sending one-sample
requests and waiting for the answer, through the dynamic batcher `kiln serve` runs (its max
batch and max delay) — samples served per second, and the requests' latencies.

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
    run: Run, feeds: Feeds, *, clients: int, max_batch: int, max_delay_ms: float, seconds: float
) -> Served:
    """`clients` threads sending `feeds` (one request each, back to back) for `seconds`."""
    batches = [0]
    runner = merged_runner(run)

    def counted(requests: list[Feeds]) -> list[list[np.ndarray]]:
        batches[0] += 1
        return runner(requests)

    batcher = Batcher(counted, max_batch, max_delay_ms / 1000, max_queue=max(clients, 1) * 2)
    batcher.start()
    latencies: list[float] = []
    errors: list[Exception] = []
    lock = threading.Lock()
    deadline = time.perf_counter() + seconds

    def client() -> None:
        while time.perf_counter() < deadline and not errors:
            begin = time.perf_counter()
            try:
                batcher.submit(feeds).result()
            except Exception as exc:  # reported once every client has stopped
                errors.append(exc)
                return
            with lock:
                latencies.append(time.perf_counter() - begin)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    batcher.close()
    if errors:
        raise errors[0]
    return Served(len(latencies) * samples_of(feeds) / elapsed, latencies, batches[0])
