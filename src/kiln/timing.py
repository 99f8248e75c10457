"""Latency measurement: warm-up, interleaved rounds, percentiles, jitter, ratios.

The machine is shared and noisy, so engines are never measured one after the other: each round
runs every engine (in rotating order) and speedups are the median of per-round P50 ratios.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np


@dataclass
class LatencyStats:
    runs: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    jitter: float  # (P99 − P50) / P50
    throughput: float  # samples per second at the measured batch size

    def to_json(self) -> dict:
        return asdict(self)


def stats(seconds: list[float], batch: int = 1) -> LatencyStats:
    data = np.asarray(seconds) * 1e3
    p50, p90, p99 = (float(np.percentile(data, q)) for q in (50, 90, 99))
    return LatencyStats(
        runs=len(data),
        p50_ms=p50,
        p90_ms=p90,
        p99_ms=p99,
        mean_ms=float(data.mean()),
        jitter=(p99 - p50) / p50 if p50 > 0 else 0.0,
        throughput=batch * 1e3 / float(data.mean()) if data.mean() > 0 else 0.0,
    )


def _time(run: Callable[[], object], count: int) -> list[float]:
    out = []
    for _ in range(count):
        start = time.perf_counter()
        run()
        out.append(time.perf_counter() - start)
    return out


def interleave(
    runners: dict[str, Callable[[], object]],
    rounds: int = 5,
    runs: int = 10,
    warmup: int = 3,
    on_round: Callable[[int], None] | None = None,
) -> dict[str, list[list[float]]]:
    """Per engine, per round, the per-run latencies in seconds."""
    names = list(runners)
    for name in names:
        _time(runners[name], warmup)
    samples: dict[str, list[list[float]]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(_time(runners[name], runs))
        if on_round is not None:
            on_round(round_index + 1)
    return samples


def round_ratios(samples: dict[str, list[list[float]]], baseline: str) -> dict[str, float]:
    """Median over rounds of P50(baseline) / P50(engine): > 1 means faster than the baseline."""
    out = {}
    for name, rounds in samples.items():
        ratios = [
            statistics.median(base) / statistics.median(mine)
            for base, mine in zip(samples[baseline], rounds, strict=True)
        ]
        out[name] = statistics.median(ratios)
    return out


def flatten(rounds: list[list[float]]) -> list[float]:
    return [x for r in rounds for x in r]
