"""kiln.timing's primitives: the one timed loop, the one bootstrap and the one verdict, which
every measuring package (optimize, bench, tune, the training tuner, split) judges by."""

from __future__ import annotations

import numpy as np
import pytest

from kiln.timing import (
    FASTER,
    GAIN,
    SAME,
    SLOWER,
    SPEED,
    Vocabulary,
    bootstrap,
    median_ms,
    speedup,
    time_runs,
    verdict_of,
)
from kiln.tune.confirm import verdict
from kiln.tune.measure import speedup_interval
from kiln.tune.objectives import OBJECTIVES


@pytest.mark.parametrize(
    ("low", "high", "speed", "gain"),
    [
        (1.02, 1.30, FASTER, "better"),
        (0.97, 1.05, SAME, "no better"),
        (1.00, 1.00, SAME, "no better"),  # an interval touching the mark is within noise
        (0.70, 0.99, SLOWER, "worse"),
    ],
)
def test_one_verdict_speaks_each_vocabulary(low, high, speed, gain):
    assert verdict_of(low, high) == verdict_of(low, high, SPEED) == speed
    assert verdict_of(low, high, GAIN) == gain


def test_a_verdict_takes_its_mark_and_a_noise_margin():
    words = Vocabulary("up", "level", "down")
    assert verdict_of(0.1, 0.2, words, mark=0.0) == "up"
    assert verdict_of(-0.1, 0.2, words, mark=0.0) == "level"
    # A single figure with 5 % either way taken as noise.
    assert [verdict_of(r, r, words, margin=0.05) for r in (1.06, 1.04, 0.96, 0.94)] == [
        "up", "level", "level", "down"]  # fmt: skip


def test_the_tuners_confirmation_says_better_only_beyond_its_interval():
    def gains(p99_tuned, p99_defaults, memory=(100.0, 100.0)):
        tuned = {"p99_ms": dict(zip(("value", "low", "high"), p99_tuned, strict=True))}
        defaults = {"p99_ms": dict(zip(("value", "low", "high"), p99_defaults, strict=True))}
        tuned["memory_mib"], defaults["memory_mib"] = memory
        return {"tuned": tuned, "defaults": defaults, "speedup": {"low": 1.01, "high": 1.2}}

    p50, p99, memory = (OBJECTIVES[name] for name in ("latency", "p99", "memory"))
    assert verdict(p50, gains((1, 1, 1), (1, 1, 1))) == "better"
    assert verdict(p99, gains((4, 3, 5), (7, 6, 8))) == "better"  # lower is better
    assert verdict(p99, gains((4, 3, 6.5), (7, 6, 8))) == "no better"
    assert verdict(p99, gains((9, 8.5, 10), (7, 6, 8))) == "worse"
    assert verdict(memory, gains((1, 1, 1), (1, 1, 1), (90.0, 100.0))) == "better"
    assert verdict(memory, gains((1, 1, 1), (1, 1, 1), (97.0, 100.0))) == "no better"
    assert verdict(memory, gains((1, 1, 1), (1, 1, 1), (110.0, 100.0))) == "worse"


def test_the_timed_loop_times_each_run_after_its_warmup():
    calls = []
    seconds = time_runs(lambda: calls.append(1), 5, warmup=2)
    assert len(calls) == 7 and len(seconds) == 5 and all(s >= 0 for s in seconds)
    assert time_runs(lambda: None, 0, warmup=3) == []
    assert median_ms(lambda: calls.append(1), 0) >= 0 and len(calls) == 9  # 1 warm-up + 1 timed


def test_a_time_limit_stops_the_loop_but_never_before_its_minimum():
    assert len(time_runs(lambda: None, 1000, seconds=0.0, at_least=20)) == 20
    assert len(time_runs(lambda: None, 10, seconds=0.0, at_least=20)) == 10  # count first
    assert len(time_runs(lambda: None, 50, seconds=3600.0)) == 50


def test_the_bootstrap_redraws_as_numpy_would_and_is_seeded():
    data = np.random.default_rng(1).normal(1.0, 0.1, 40)
    picks = np.random.default_rng(0).integers(0, len(data), size=(1000, len(data)))
    low, high = np.percentile(np.median(data[picks], axis=1), [2.5, 97.5])
    got = bootstrap(list(data))
    assert (got.value, got.low, got.high) == (float(np.median(data)), float(low), float(high))
    assert bootstrap(list(data), seed=3) == bootstrap(list(data), seed=3) != got
    assert bootstrap([2.0]) == type(got)(2.0, 2.0, 2.0)


def test_a_speedup_interval_redraws_rounds_in_pairs_around_the_speedup():
    rng = np.random.default_rng(2)
    base = [list(rng.normal(2.0, 0.05, 10)) for _ in range(8)]
    engine = [list(rng.normal(1.0, 0.05, 10)) for _ in range(8)]
    interval = speedup_interval(base, engine)
    assert interval.value == speedup(base, engine).value
    assert interval.low <= interval.value <= interval.high
    assert verdict_of(interval.low, interval.high) == FASTER
