"""The host's jitter floor: how much a fixed amount of work varies from run to run here, now.

A jitter Kiln prints means little alone: on a shared machine even a pure-Python loop of
fixed work has a tail, even on a quiet machine, and far more while others run ("Measuring on
a shared machine" in docs/contributing/engine-notes.md). So the
floor is measured with fixed-work probes (a pure-Python loop and an fp32 numpy matmul, each
sized to about 1 ms here) in interleaved windows (the probes take turns, so both see the same
moments of the machine), with the same statistics as every engine's jitter (`kiln.timing.
round_stats`: P50 the median of the window medians, P99 over every run) and a seeded
bootstrap interval. The floor is the lower of the probes' jitters: the least tail any
work shows here. It is about this moment's load, so it is measured, never cached.
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kiln.timing import MIN_RUNS_FOR_P99, round_stats, tail_interval, time_runs

TARGET_SECONDS = 1e-3  # per probe run: long enough to time, short enough for 1,000 of them
FLOOR_RUNS = 1000  # per probe: the minimum for a jitter floor
FLOOR_WINDOWS = 10
# Untimed probe runs before each window kiln bench takes between its engines' rounds.
SETTLE_S = 0.05
_SIZING_RUNS = 5  # at least this many runs per size tried; the fastest counts
_SIZING_STEPS = 12
_SIZING_SECONDS = 0.02  # per size tried
# Bounds of the sizing. The matmul's lower one keeps it a GEMM numpy's BLAS threads share
# (a 48×48 one is fixed costs on one thread), whatever a busy moment makes the sizing say.
_LOOP_SIZES = (1_000, 20_000_000)
_MATMUL_SIZES = (128, 4096)

Clock = Callable[[], int]  # nanoseconds, as time.perf_counter_ns
# The probe whose work runs on every core (numpy's BLAS threads): on a 2-core VM, fixed work
# on both cores read 1.5–2× the jitter of fixed work on one (benchmarks/jitter_threads.py), so
# an engine using every core is also set beside this probe's jitter.
PARALLEL_PROBE = "numpy-matmul"


@dataclass(frozen=True)
class Probe:
    """A fixed amount of work: `run` does the same thing every call."""

    name: str
    work: str  # what one run does, in words
    run: Callable[[], object]


@dataclass(frozen=True)
class ProbeJitter:
    """One probe's latency statistics over all its windows."""

    probe: str
    work: str
    runs: int
    windows: int
    p50_ms: float
    p99_ms: float
    jitter: float
    jitter_interval: tuple[float, float]
    p99_interval_ms: tuple[float, float]

    def to_json(self) -> dict:
        return {
            "probe": self.probe,
            "work": self.work,
            "runs": self.runs,
            "windows": self.windows,
            "p50_ms": self.p50_ms,
            "p99_ms": self.p99_ms,
            "jitter": self.jitter,
            "jitter_interval": list(self.jitter_interval),
            "p99_interval_ms": list(self.p99_interval_ms),
            "p99_backed": self.runs >= MIN_RUNS_FOR_P99,
        }


@dataclass(frozen=True)
class JitterFloor:
    """The floor (the lower probe jitter), which probe gave it, and every probe's figures."""

    floor: float
    probe: str
    probes: dict[str, ProbeJitter]
    measured: str  # how and when: "now, in this run" or "interleaved with the engines"
    measured_at: str  # ISO 8601, UTC
    # Each probe's run times in seconds, per window: what an interval of a ratio to the
    # floor resamples (kiln.timing.jitter_ratio_interval). Not in the JSON.
    windows: dict[str, list[list[float]]] = field(default_factory=dict, repr=False)

    def to_json(self) -> dict:
        return {
            "floor": self.floor,
            "probe": self.probe,
            "floor_interval": list(self.probes[self.probe].jitter_interval),
            "definition": "the lower of the fixed-work probes' jitters, (P99 − P50) / P50",
            "measured": self.measured,
            "measured_at": self.measured_at,
            "probes": {name: p.to_json() for name, p in self.probes.items()},
        }


def jitter_floor(
    runs: int = FLOOR_RUNS,
    windows: int = FLOOR_WINDOWS,
    *,
    seed: int = 0,
    probes: list[Probe] | None = None,
    clock: Clock = time.perf_counter_ns,
) -> JitterFloor:
    """This host's jitter floor now: `runs` runs of each probe in `windows` interleaved
    windows (about 2 × runs × 1 ms with the default probes)."""
    sampler = FloorSampler(probes, clock)
    per_window = max(runs // max(windows, 1), 1)
    for _ in range(max(windows, 1)):
        sampler.window(per_window)
    return sampler.result(seed, measured="now, in this run (never cached)")


class FloorSampler:
    """The probes and the windows timed so far: a caller that times other work (kiln bench)
    takes one `window` between its own rounds, so the probes see the same conditions."""

    def __init__(
        self,
        probes: list[Probe] | None = None,
        clock: Clock = time.perf_counter_ns,
        target_s: float = TARGET_SECONDS,
    ):
        """`target_s`: how long one probe run takes. A caller timing a model sizes it to the
        model's run: a stall of a millisecond is a jitter of 1 for a 1 ms probe and 0.02 for
        a 50 ms model, so only work of the same length shows the floor that model meets."""
        self.probes = probes if probes is not None else default_probes(target_s, clock)
        self.clock = clock
        self.samples: dict[str, list[list[float]]] = {p.name: [] for p in self.probes}

    def window(self, runs: int) -> None:
        """Time `runs` runs of each probe, the order rotating from window to window, each
        after SETTLE_S of untimed runs: a window follows an engine's round, whose thread pool
        may still spin on the cores for milliseconds (inside kiln bench the python loop's
        first runs after ONNX Runtime read several times the jitter it reads alone: "Measuring
        on a shared machine" in docs/contributing/engine-notes.md)."""
        shift = len(self.samples[self.probes[0].name]) % len(self.probes)
        for probe in self.probes[shift:] + self.probes[:shift]:
            _settle(probe.run, self.clock)
            self.samples[probe.name].append(time_runs(probe.run, runs, clock=self.clock))

    def result(self, seed: int = 0, measured: str = "") -> JitterFloor:
        works = {p.name: p.work for p in self.probes}
        found = {name: probe_jitter(name, works[name], w, seed) for name, w in self.samples.items()}
        lowest = min(found.values(), key=lambda p: p.jitter)
        when = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
        return JitterFloor(lowest.jitter, lowest.probe, found, measured, when, self.samples)


def _settle(run: Callable[[], object], clock: Clock) -> None:
    """Run `run` untimed for SETTLE_S (at least once)."""
    end = clock() + int(SETTLE_S * 1e9)
    run()
    while clock() < end:
        run()


def probe_jitter(name: str, work: str, windows: list[list[float]], seed: int = 0) -> ProbeJitter:
    """A probe's statistics from its per-window run times in seconds (any timings: the
    arithmetic is testable without a clock)."""
    point = round_stats(windows)
    interval = tail_interval(windows, seed=seed)
    return ProbeJitter(
        probe=name,
        work=work,
        runs=point.runs,
        windows=len(windows),
        p50_ms=point.p50_ms,
        p99_ms=point.p99_ms,
        jitter=point.jitter,
        jitter_interval=interval.jitter,
        p99_interval_ms=interval.p99_ms,
    )


# ---------------------------------------------------------------------------- probes
def default_probes(
    target_s: float = TARGET_SECONDS, clock: Clock = time.perf_counter_ns
) -> list[Probe]:
    """A pure-Python loop (the interpreter alone) and an fp32 matmul (numpy's BLAS and its
    threads), each sized here to take about `target_s`."""
    return [python_loop_probe(target_s, clock), numpy_matmul_probe(target_s, clock)]


def python_loop_probe(
    target_s: float = TARGET_SECONDS, clock: Clock = time.perf_counter_ns
) -> Probe:
    n = _sized(_python_loop, _LOOP_SIZES, 1, target_s, clock)
    return Probe("python-loop", f"pure-Python loop of {n:,} additions", _python_loop(n))


def numpy_matmul_probe(
    target_s: float = TARGET_SECONDS, clock: Clock = time.perf_counter_ns
) -> Probe:
    n = _sized(_matmul, _MATMUL_SIZES, 3, target_s, clock)
    return Probe("numpy-matmul", f"numpy fp32 matmul {n}×{n} @ {n}×{n}", _matmul(n))


def _python_loop(n: int) -> Callable[[], int]:
    def run() -> int:
        total = 0
        for i in range(n):
            total += i
        return total

    return run


def _matmul(n: int) -> Callable[[], np.ndarray]:
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n), dtype=np.float32) for _ in range(2))
    out = np.empty((n, n), np.float32)  # into the same array: no allocation in the timed work
    return lambda: np.matmul(a, b, out=out)


def _sized(
    make: Callable[[int], Callable[[], object]],
    sizes: tuple[int, int],
    exponent: int,
    target_s: float,
    clock: Clock,
) -> int:
    """The size (within `sizes`, lowest and highest) whose run takes about `target_s`: the
    time of the fastest of a few runs, scaled by the work's power of the size, a few times
    over (a first estimate from fixed costs or a disturbed moment is corrected); below a
    tenth of the target fixed costs may dominate, so the work grows at most 8× a step. A
    size that lands near the target is timed twice: a moment when the BLAS threads wait for
    a core can make a GEMM of 128² take as long as one of 1,024² for tens of milliseconds."""
    low, high = sizes
    n = low
    for _ in range(_SIZING_STEPS):
        seconds = _best(make(n), clock)
        if target_s / 2 <= seconds <= 2 * target_s:
            seconds = min(seconds, _best(make(n), clock))
        if target_s / 2 <= seconds <= 2 * target_s:
            break
        grow = (target_s / seconds) ** (1 / exponent)
        if seconds < target_s / 10:  # fixed costs may dominate: at most 8× the work at once
            grow = min(grow, 8 ** (1 / exponent))
        resized = int(min(max(round(n * grow), low), high))
        if resized == n:  # at a bound
            break
        n = resized
    return n


def _best(run: Callable[[], object], clock: Clock) -> float:
    """The fastest run after a warm-up, in seconds (the least disturbed one), of at least
    `_SIZING_RUNS` and for at least `_SIZING_SECONDS`: a busy moment (BLAS threads waiting
    for a core) can last longer than a few runs."""
    run()
    best, start, count = float("inf"), clock(), 0
    while count < _SIZING_RUNS or (clock() - start < _SIZING_SECONDS * 1e9 and count < 1000):
        best = min(best, *time_runs(run, 1, clock=clock))
        count += 1
    return best
