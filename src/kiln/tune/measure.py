"""Honest measurement for the tuner: a trial is timed interleaved against the incumbent,
round after round, until the confidence interval of their ratio is tight or the trial's time
is spent; tails (P99, jitter) are statistics over windows of runs with a bootstrap interval,
never one run's tail (a single run's P99 moves several-fold on a shared machine)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kiln.timing import Interval, bootstrap, flatten, interleave, speedup

WINDOW = 50  # runs per tail window: P99 of 50 runs is their worst but one (the 49.5th)


@dataclass(frozen=True)
class Tails:
    """Latency over windows of runs: P50, P99 and jitter (P99 − P50)/P50, each the median
    over windows, with bootstrap intervals."""

    p50_ms: Interval
    p99_ms: Interval
    jitter: Interval
    runs: int

    def to_json(self) -> dict:
        return {
            "p50_ms": self.p50_ms.to_json(),
            "p99_ms": self.p99_ms.to_json(),
            "jitter": self.jitter.to_json(),
            "runs": self.runs,
        }


def tails(seconds: list[float], window: int = WINDOW) -> Tails:
    ms = np.asarray(seconds) * 1e3
    count = max(1, len(ms) // window)
    windows = [w for w in np.array_split(ms, count) if len(w)]
    p50 = [float(np.percentile(w, 50)) for w in windows]
    p99 = [float(np.percentile(w, 99)) for w in windows]
    jitter = [(b - a) / a if a > 0 else 0.0 for a, b in zip(p50, p99, strict=True)]
    return Tails(bootstrap(p50), bootstrap(p99), bootstrap(jitter), len(ms))


def round_p50s(rounds: list[list[float]]) -> Interval:
    """The P50 in ms as `kiln.timing.round_p50_ms` takes it (the median of per-round
    medians) with its bootstrap interval over rounds."""
    return bootstrap([statistics.median(r) * 1e3 for r in rounds])


def speedup_interval(baseline: list[list[float]], engine: list[list[float]],
                     seed: int = 0) -> Interval:  # fmt: skip
    """How much faster `engine` ran than `baseline` (per round, the per-run seconds of each,
    interleaved): the value is `kiln.timing.speedup`'s — the ratio of the two `round_p50s`,
    so the P50s printed beside it always agree with it — and the interval its 95 % bootstrap
    interval, resampling rounds in pairs (the two sides of a round shared the machine)."""
    value = speedup(baseline, engine).value
    if len(engine) < 2:
        return Interval(value, value, value)
    rows = [(statistics.median(b), statistics.median(e))
            for b, e in zip(baseline, engine, strict=True)]  # fmt: skip
    drawn = bootstrap(rows, _ratio_of_medians, seed=seed)
    return Interval(value, min(drawn.low, value), max(drawn.high, value))


def _ratio_of_medians(drawn: np.ndarray) -> np.ndarray:
    """Per resample of (baseline, engine) rows: median(baseline) / median(engine)."""
    return np.median(drawn[..., 0], axis=1) / np.median(drawn[..., 1], axis=1)


@dataclass(frozen=True)
class Duel:
    """A trial against the incumbent, interleaved: the ratio of their P50s (trial /
    incumbent: below 1 is faster; 1 / `speedup_interval`) with its interval, and each side's
    runs, per round."""

    ratio: Interval
    trial_rounds: list[list[float]]
    incumbent_rounds: list[list[float]]

    @property
    def rounds(self) -> int:
        return len(self.trial_rounds)

    @property
    def trial_s(self) -> list[float]:
        return flatten(self.trial_rounds)

    @property
    def incumbent_s(self) -> list[float]:
        return flatten(self.incumbent_rounds)

    @property
    def speedup(self) -> Interval:
        """incumbent / trial: above 1 the trial is faster."""
        return Interval(1 / self.ratio.value, 1 / self.ratio.high, 1 / self.ratio.low)

    def to_json(self) -> dict:
        return {"ratio": self.ratio.to_json(), "rounds": self.rounds}


def duel(
    trial: Callable[[], object],
    incumbent: Callable[[], object],
    *,
    seconds: float,
    runs: int = 10,
    min_rounds: int = 3,
    tight: float = 0.02,
    min_runs: int = 0,
    give_up_above: float | None = None,
    limit_s: float | None = None,
) -> Duel:
    """Rounds of `runs` runs each, alternating who goes first, until the ratio's interval is
    within ±`tight` (relative) or `seconds` are spent — but never before each side has
    `min_runs` runs and `min_rounds` rounds, unless `limit_s` (a hard bound: the user's
    --time) is spent. A trial clearly slower than `give_up_above` × the incumbent (its whole
    interval above) is not measured further: pruned, not refined."""
    start = time.perf_counter()
    rounds: dict[str, list[list[float]]] = {"trial": [], "incumbent": []}
    warm = True
    while True:
        got = interleave(
            {"trial": trial, "incumbent": incumbent} if len(rounds["trial"]) % 2 == 0
            else {"incumbent": incumbent, "trial": trial},
            rounds=1, runs=runs, warmup=3 if warm else 0,
        )  # fmt: skip
        warm = False
        for name in rounds:
            rounds[name] += got[name]
        ratio = _ratio(rounds)
        enough = len(rounds["trial"]) >= min_rounds
        if enough and give_up_above is not None and ratio.low > give_up_above:
            break
        spent = time.perf_counter() - start
        if enough and limit_s is not None and spent >= limit_s:
            break
        done = enough and len(rounds["trial"]) * runs >= min_runs
        if done and (ratio.halfwidth <= tight or spent >= seconds):
            break
    return Duel(ratio, rounds["trial"], rounds["incumbent"])


def _ratio(rounds: dict[str, list[list[float]]]) -> Interval:
    """P50(trial) / P50(incumbent) with its interval: `speedup_interval` with the trial as
    the baseline, one statistic for the search and the confirmation."""
    return speedup_interval(rounds["trial"], rounds["incumbent"])
