"""Latency measurement: the one timed loop (`time_runs`), warm-up, interleaved rounds,
percentiles, jitter, ratios, the one bootstrap (`bootstrap`, and the tail intervals drawn the
same way) and the one verdict (`verdict_of`, in the vocabulary its caller speaks).

The machine is shared and noisy, so engines are never measured one after the other: each round
runs every engine (in rotating order). An engine's P50 is the median of its per-round P50s, a
speedup is the ratio of two such P50s (so the figures printed beside it always agree with it),
and the per-round ratios give its spread and the verdict: faster, no different within noise,
or slower.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
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


def time_runs(
    run: Callable[[], object],
    count: int,
    *,
    warmup: int = 0,
    seconds: float | None = None,
    at_least: int = 0,
    clock: Callable[[], int] = time.perf_counter_ns,
) -> list[float]:
    """Seconds of each of `count` runs of `run`, each timed on its own with the nanosecond
    `clock` (a test hands in its own), after `warmup` untimed ones. With `seconds`, the runs
    stop once that much time has passed since the first timed one began, but never before
    `at_least` of them are timed."""
    for _ in range(warmup):
        run()
    out: list[float] = []
    began = clock()
    while len(out) < count:
        late = seconds is not None and (clock() - began) / 1e9 >= seconds
        if late and len(out) >= at_least:
            break
        start = clock()
        run()
        out.append((clock() - start) / 1e9)
    return out


def median_ms(run: Callable[[], object], runs: int, warmup: int = 1) -> float:
    """The median of `runs` timed runs (at least one) after `warmup` untimed ones, in ms."""
    return statistics.median(time_runs(run, max(runs, 1), warmup=warmup)) * 1e3


def interleave(
    runners: dict[str, Callable[[], object]],
    rounds: int = 5,
    runs: int = 10,
    warmup: int = 3,
    on_round: Callable[[int], None] | None = None,
    settle: int = 1,
) -> dict[str, list[list[float]]]:
    """Per engine, per round, the per-run latencies in seconds.

    Each block starts with `settle` untimed runs: the first run after another engine's block
    pays for that engine's threads still spinning on the cores and for the caches it left —
    about one run in a hundred, exactly a P99, and well above the P50 ("Measuring on a shared
    machine" in docs/contributing/engine-notes.md). The
    blocks are there to share the machine's drift, not to time the switch; what alternating
    sessions cost each other is measured apart (benchmarks/steady.py)."""
    names = list(runners)
    for name in names:
        time_runs(runners[name], 0, warmup=warmup)
    samples: dict[str, list[list[float]]] = {name: [] for name in names}
    for round_index in range(rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(time_runs(runners[name], runs, warmup=settle))
        if on_round is not None:
            on_round(round_index + 1)
    return samples


# Below this many rounds the per-round ratios say nothing about the noise.
MIN_ROUNDS_FOR_SPREAD = 3
FASTER, SAME, SLOWER, UNKNOWN, BASELINE = (
    "faster", "no different within noise", "slower", "unknown", "baseline"
)  # fmt: skip


@dataclass(frozen=True)
class Speedup:
    """How much faster an engine ran than the baseline, and whether that is beyond noise.

    `value` = P50(baseline) / P50(engine), each P50 the median of per-round P50s; `spread` is
    the lowest and highest per-round P50 ratio (None below MIN_ROUNDS_FOR_SPREAD rounds, where
    the noise is unknown); the verdict is "faster" when every round says so, "slower" when
    every round says so, otherwise "no different within noise"."""

    value: float
    spread: tuple[float, float] | None
    verdict: str

    def to_json(self) -> dict:
        spread = None if self.spread is None else [self.spread[0], self.spread[1]]
        return {"speedup": self.value, "speedup_spread": spread, "verdict": self.verdict}


def round_p50_ms(rounds: list[list[float]]) -> float:
    """The median over rounds of each round's P50, in ms: one bad round cannot move it."""
    return statistics.median(statistics.median(r) for r in rounds) * 1e3


def round_stats(rounds: list[list[float]], batch: int = 1) -> LatencyStats:
    """Statistics of interleaved rounds: P50 as `round_p50_ms` (the figure speedups are ratios
    of), the tails, mean and throughput over every run."""
    flat = stats(flatten(rounds), batch)
    p50 = round_p50_ms(rounds)
    flat.p50_ms = p50
    flat.jitter = (flat.p99_ms - p50) / p50 if p50 > 0 else 0.0
    return flat


def speedup(baseline: list[list[float]], engine: list[list[float]]) -> Speedup:
    """The one place a speedup, its spread and its verdict are derived (optimize, auto's
    choice and bench all use it). Both arguments: per round, the per-run latencies."""
    value = round_p50_ms(baseline) / round_p50_ms(engine)
    if len(engine) < MIN_ROUNDS_FOR_SPREAD:
        return Speedup(value, None, UNKNOWN)
    ratios = round_ratios(baseline, engine)
    low, high = min(min(ratios), value), max(max(ratios), value)
    return Speedup(value, (low, high), verdict_of(low, high))


def round_ratios(baseline: list[list[float]], engine: list[list[float]]) -> list[float]:
    """Each round's P50(baseline) / P50(engine): above 1, the engine was faster that round."""
    return [
        statistics.median(b) / statistics.median(e) for b, e in zip(baseline, engine, strict=True)
    ]


@dataclass(frozen=True)
class Vocabulary:
    """What a verdict calls an interval wholly above its mark, one that holds it, and one
    wholly below."""

    above: str
    within: str
    below: str


SPEED = Vocabulary(FASTER, SAME, SLOWER)  # a speedup: P50(baseline) / P50(engine)
GAIN = Vocabulary("better", "no better", "worse")  # a tuned pick against what it replaces


def verdict_of(
    low: float, high: float, words: Vocabulary = SPEED, *, mark: float = 1.0, margin: float = 0.0
) -> str:
    """The one judgement of "beyond noise": `words.above` when the whole interval [low, high]
    lies above `mark` + `margin`, `words.below` when it lies below `mark` − `margin`, else
    `words.within`. For a speedup's per-round ratios: faster when every round says so, slower
    when every one does, else no different within noise."""
    if low > mark + margin:
        return words.above
    if high < mark - margin:
        return words.below
    return words.within


def speedups(samples: dict[str, list[list[float]]], baseline: str) -> dict[str, Speedup]:
    """Every engine's `speedup` against `baseline`; the baseline's own is 1× by definition."""
    out = {name: speedup(samples[baseline], rounds) for name, rounds in samples.items()}
    out[baseline] = Speedup(1.0, (1.0, 1.0), BASELINE)
    return out


def flatten(rounds: list[list[float]]) -> list[float]:
    return [x for r in rounds for x in r]


# MLPerf's figure: fewer runs than this cannot back a P99 at 99 %
# confidence, so a P99 from fewer is reported as such (`p99_backed`), not hidden.
MIN_RUNS_FOR_P99 = 662
BOOTSTRAP_RESAMPLES = 1000
# Elements one bootstrap chunk draws at once: bounds the memory of long benchmarks.
_BOOTSTRAP_CHUNK = 4_000_000
# Total elements drawn over all resamples: a benchmark of millions of runs gets fewer
# resamples rather than minutes of bootstrap.
_BOOTSTRAP_BUDGET = 50_000_000


def p99_backing(runs: int) -> dict[str, int | bool]:
    """How many runs a P99 stands on and whether they back it, as every JSON that prints a
    P99 says it (`p99_runs`, `p99_backed`)."""
    return {"p99_runs": runs, "p99_backed": runs >= MIN_RUNS_FOR_P99}


@dataclass(frozen=True)
class TailInterval:
    """Bootstrap intervals (percentile method) of `round_stats`' P99 and jitter.

    Each resample redraws the runs of every round (window) from that round's own runs, with
    replacement, and computes P50 and P99 exactly as `round_stats` does, so the interval is
    that of the figure printed beside it."""

    p99_ms: tuple[float, float]
    jitter: tuple[float, float]
    confidence: float
    resamples: int

    def to_json(self) -> dict:
        return {
            "p99_interval_ms": list(self.p99_ms),
            "jitter_interval": list(self.jitter),
            "interval_confidence": self.confidence,
            "bootstrap_resamples": self.resamples,
        }


def tail_interval(
    rounds: list[list[float]],
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
    confidence: float = 0.95,
) -> TailInterval:
    """Bootstrap intervals of the P99 and jitter of interleaved rounds (seconds per run).

    Seeded, so the same runs always give the same interval. Each interval is widened to hold
    the estimate itself: resamples of a P99 from few runs rarely redraw the slowest run, so
    a pure percentile interval can sit wholly below the figure it is meant to qualify."""
    windows = _windows_ms(rounds)
    point = round_stats(rounds)
    count = _resample_count(resamples, windows)
    p50, p99 = _bootstrap(windows, count, np.random.default_rng(seed))
    tail = (1 - confidence) / 2 * 100
    return TailInterval(
        p99_ms=_holding(np.percentile(p99, [tail, 100 - tail]), point.p99_ms),
        jitter=_holding(np.percentile(_jitters(p50, p99), [tail, 100 - tail]), point.jitter),
        confidence=confidence,
        resamples=count,
    )


def jitter_ratio_interval(
    rounds: list[list[float]],
    floor_rounds: list[list[float]],
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
    confidence: float = 0.95,
) -> tuple[float, float]:
    """Bootstrap interval of jitter(`rounds`) ÷ jitter(`floor_rounds`): how many times the
    host's floor an engine's jitter is, with the noise of both figures in it. Each side's
    runs are redrawn within its own rounds (the two are different runs: the engine's and the
    floor probe's), and the i-th draws divided. Widened to hold the ratio itself."""
    windows, floor_windows = _windows_ms(rounds), _windows_ms(floor_rounds)
    count = min(_resample_count(resamples, windows), _resample_count(resamples, floor_windows))
    rng = np.random.default_rng(seed)
    jitter = _jitters(*_bootstrap(windows, count, rng))
    floor = _jitters(*_bootstrap(floor_windows, count, rng))
    ratio = np.divide(jitter, floor, out=np.full_like(jitter, np.inf), where=floor > 0)
    point_floor = round_stats(floor_rounds).jitter
    point = round_stats(rounds).jitter / point_floor if point_floor > 0 else float("inf")
    tail = (1 - confidence) / 2 * 100
    # Interpolating between infinite ratios gives NaN: that bound is infinite.
    bounds = np.nan_to_num(np.percentile(ratio, [tail, 100 - tail]), nan=np.inf, posinf=np.inf)
    return _holding(bounds, point)


def _windows_ms(rounds: list[list[float]]) -> list[np.ndarray]:
    windows = [np.asarray(r, dtype=float) * 1e3 for r in rounds if len(r)]
    if not windows:
        raise ValueError("a bootstrap interval needs at least one run")
    return windows


def _resample_count(resamples: int, windows: list[np.ndarray]) -> int:
    return max(min(resamples, _BOOTSTRAP_BUDGET // sum(len(w) for w in windows)), 1)


def _jitters(p50: np.ndarray, p99: np.ndarray) -> np.ndarray:
    return np.divide(p99 - p50, p50, out=np.zeros_like(p50), where=p50 > 0)


def _bootstrap(
    windows: list[np.ndarray], count: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """`count` resamples' (P50 as the median of window medians, P99 over every run)."""

    def p50_p99(drawn: list[np.ndarray]) -> np.ndarray:
        medians = np.stack([np.median(d, axis=1) for d in drawn], axis=1)
        p99 = np.percentile(np.concatenate(drawn, axis=1), 99, axis=1)
        return np.stack([np.median(medians, axis=1), p99], axis=1)

    both = _resampled(windows, count, rng, p50_p99)
    return both[:, 0], both[:, 1]


def _resampled(
    groups: list[np.ndarray],
    count: int,
    rng: np.random.Generator,
    stat: Callable[[list[np.ndarray]], np.ndarray],
) -> np.ndarray:
    """The one bootstrap draw: `stat` of `count` resamples, each redrawing every group's rows
    from that group alone, with replacement. `stat` maps the groups' draws, each shaped
    (resamples, rows, ...), to one figure (or row of figures) per resample. Drawn in chunks
    so that no chunk holds more than `_BOOTSTRAP_CHUNK` rows."""
    step = max(_BOOTSTRAP_CHUNK // sum(len(g) for g in groups), 1)
    chunks = []
    for start in range(0, count, step):
        size = min(step, count - start)
        chunks.append(stat([g[rng.integers(0, len(g), (size, len(g)))] for g in groups]))
    return np.concatenate(chunks)


@dataclass(frozen=True)
class Interval:
    """A figure and its bootstrap interval."""

    value: float
    low: float
    high: float

    @property
    def halfwidth(self) -> float:
        """Relative half-width of the interval."""
        return (self.high - self.low) / 2 / abs(self.value) if self.value else float("inf")

    def to_json(self) -> dict:
        return {"value": self.value, "low": self.low, "high": self.high}


def median_of(drawn: np.ndarray) -> np.ndarray:
    """Each resample's median: `bootstrap`'s default statistic."""
    return np.median(drawn, axis=1)


def bootstrap(
    values: Sequence[float] | np.ndarray,
    stat: Callable[[np.ndarray], np.ndarray] = median_of,
    seed: int = 0,
    resamples: int = BOOTSTRAP_RESAMPLES,
) -> Interval:
    """`stat` of `values` and its 95 % bootstrap interval (percentile method), seeded. The
    values may be rows (a round's two sides, redrawn together); `stat` maps draws shaped
    (resamples, len(values), ...) to one figure per resample."""
    data = np.asarray(values, dtype=np.float64)
    if len(data) < 2:
        value = float(stat(data[None])[0]) if len(data) else float("nan")
        return Interval(value, value, value)
    figures = _resampled([data], resamples, np.random.default_rng(seed), lambda d: stat(d[0]))
    low, high = np.percentile(figures, [2.5, 97.5])
    return Interval(float(stat(data[None])[0]), float(low), float(high))


def _holding(bounds: np.ndarray, estimate: float) -> tuple[float, float]:
    return min(float(bounds[0]), estimate), max(float(bounds[1]), estimate)


def cqi(roofline_fraction: float, jitter: float) -> float:
    """The quality index the reference system defines: fraction of the measured roofline ×
    (1 − jitter), each clamped to [0, 1] so the index is too (a peak measured on a busy
    machine can be beaten; a jitter above 1 means the tail is more than twice the median)."""
    fraction = min(max(roofline_fraction, 0.0), 1.0)
    return fraction * (1.0 - min(max(jitter, 0.0), 1.0))
