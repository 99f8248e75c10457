"""The jitter floor (kiln.hardware.jitter), the bootstrap interval and CQI (kiln.timing), and
where they show: `kiln doctor` and `kiln bench` put every jitter beside the host's floor.

The statistics are checked on synthetic timings (a fake clock, a probe that "sleeps" on every
20th call in fake time); the real probes and verbs only for sanity, never for their values."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from rich.console import Console
from typer.testing import CliRunner

from kiln.cli import app
from kiln.hardware import FloorSampler, Peaks, jitter_floor, measured_peaks
from kiln.hardware import peaks as peaks_module
from kiln.hardware.jitter import Probe, probe_jitter
from kiln.report.terminal import print_bench, print_doctor
from kiln.timing import (
    MIN_RUNS_FOR_P99,
    cqi,
    jitter_ratio_interval,
    round_stats,
    tail_interval,
    time_runs,
)

MS = 1_000_000  # nanoseconds
# Peaks far above what a tiny model reaches on a CPU: its roofline fraction stays below 1.
FAKE_PEAKS = Peaks(10_000.0, None, 40_000.0, 20.0, 2, "2026-01-01T00:00:00+00:00")


class FakeClock:
    """Nanoseconds that advance only when a fake probe runs: timings with no real time."""

    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now

    def probe(self, name: str, spike_every: int | None = None) -> Probe:
        """~1 ms of fake work with a little steady variation; `spike_every`: every such call
        also "sleeps" 5 ms, as a host that preempts the work does."""
        calls = [0]

        def run() -> None:
            calls[0] += 1
            self.now += MS + (calls[0] % 7) * 10_000
            if spike_every and calls[0] % spike_every == 0:
                self.now += 5 * MS

        return Probe(name, f"fake {name}", run)


def fake_floor(windows: int = 10, runs: int = 100, seed: int = 0):
    clock = FakeClock()
    probes = [clock.probe("steady"), clock.probe("noisy", spike_every=20)]
    sampler = FloorSampler(probes, clock)
    for _ in range(windows):
        sampler.window(runs)
    return sampler.result(seed, measured="in a test")


def synthetic_windows(seed: int, windows: int = 10, runs: int = 100) -> list[list[float]]:
    rng = np.random.default_rng(seed)
    return [list(1e-3 * (1 + 0.02 * rng.standard_normal(runs))) for _ in range(windows)]


def test_a_probe_that_stalls_every_20th_run_has_the_higher_jitter_and_sets_no_floor():
    floor = fake_floor()
    steady, noisy = floor.probes["steady"], floor.probes["noisy"]
    assert steady.runs == noisy.runs == 1000 and steady.windows == 10
    assert noisy.jitter > 10 * steady.jitter > 0  # 5 % of its runs take 6 ms instead of 1
    assert floor.probe == "steady" and floor.floor == steady.jitter
    assert noisy.p99_ms == pytest.approx(6.0, rel=0.05)


def test_probe_figures_are_consistent_and_the_interval_holds_the_estimate():
    for probe in fake_floor().probes.values():
        low, high = probe.jitter_interval
        assert probe.p99_ms >= probe.p50_ms > 0
        assert low <= probe.jitter <= high
        assert probe.p99_interval_ms[0] <= probe.p99_ms <= probe.p99_interval_ms[1]
    shown = fake_floor().to_json()
    assert shown["floor_interval"] == shown["probes"]["steady"]["jitter_interval"]
    steady = shown["probes"]["steady"]
    assert steady["p99_backed"] is (steady["runs"] >= MIN_RUNS_FOR_P99) is True


def test_the_windowed_statistics_are_those_of_round_stats():
    windows = synthetic_windows(1)
    probe = probe_jitter("synthetic", "none", windows)
    expected = round_stats(windows)
    assert (probe.p50_ms, probe.p99_ms, probe.jitter) == (
        expected.p50_ms,
        expected.p99_ms,
        expected.jitter,
    )


def test_the_bootstrap_is_deterministic_for_a_seed():
    windows = synthetic_windows(2)
    assert tail_interval(windows, seed=7) == tail_interval(windows, seed=7)
    assert fake_floor(seed=3).to_json()["probes"] == fake_floor(seed=3).to_json()["probes"]
    other = tail_interval(windows, seed=8).jitter
    assert other != tail_interval(windows, seed=7).jitter  # the seed is what fixes it


def test_the_interval_narrows_with_more_runs():
    few = tail_interval(synthetic_windows(4, windows=5, runs=20)).jitter
    many = tail_interval(synthetic_windows(4, windows=10, runs=500)).jitter
    assert many[1] - many[0] < few[1] - few[0]


def stalled_windows(seed: int, every: int, windows: int = 10, runs: int = 100) -> list[list[float]]:
    """1 ms runs with 2 % noise, every `every`-th run stalled to 3 ms."""
    rounds = synthetic_windows(seed, windows, runs)
    return [[3e-3 if i % every == 0 else t for i, t in enumerate(w)] for w in rounds]


def test_the_ratio_to_the_floor_has_an_interval_that_decides_or_not():
    floor = stalled_windows(5, every=50)  # 2 % of runs stalled: P99 is a stall
    same = stalled_windows(6, every=50)
    steadier = synthetic_windows(7)  # no stall at all
    low, high = jitter_ratio_interval(same, floor)
    point = round_stats(same).jitter / round_stats(floor).jitter
    assert low <= point <= high and low < 1 < high  # the same tail: the reading cannot tell
    low, high = jitter_ratio_interval(steadier, floor)
    assert high < 0.2  # a tail of noise only, beside a floor of stalls: clearly below it
    assert jitter_ratio_interval(same, floor, seed=3) == jitter_ratio_interval(same, floor, seed=3)


def test_a_floor_whose_tail_can_vanish_gives_no_upper_bound_and_bench_none():
    from kiln.bench.report import _over_floor_interval

    one_stall = [[1e-3] * 99 + [3e-3] for _ in range(10)]  # a resample may draw no stall
    engine = synthetic_windows(8)
    assert jitter_ratio_interval(engine, one_stall)[1] == float("inf")
    floor = dataclasses.replace(fake_floor(), windows={"steady": one_stall})
    assert _over_floor_interval(engine, floor) is None  # JSON has no infinity
    assert fake_floor().windows["steady"]  # the real sampler keeps its windows


def test_cqi_is_the_fraction_times_one_minus_jitter_within_zero_and_one():
    assert cqi(0.5, 0.2) == pytest.approx(0.4)
    assert cqi(1.7, 0.0) == 1.0  # a peak measured low can be beaten: still at most 1
    assert cqi(0.5, 3.0) == 0.0 and cqi(0.0, 0.1) == 0.0
    assert cqi(0.5, -0.1) == 0.5


def test_the_real_probes_give_a_sane_floor():
    floor = jitter_floor(runs=100, windows=4)
    assert set(floor.probes) == {"python-loop", "numpy-matmul"}
    assert floor.floor == min(p.jitter for p in floor.probes.values()) >= 0
    assert floor.probes[floor.probe].jitter == floor.floor
    for probe in floor.probes.values():
        assert probe.runs == 100 and probe.p99_ms >= probe.p50_ms > 0
        assert probe.jitter_interval[0] <= probe.jitter <= probe.jitter_interval[1]


def test_probes_are_sized_to_the_run_they_stand_beside():
    """A stall of 1 ms is a jitter of 1 for a 1 ms probe and 0.02 for a 50 ms model: kiln bench
    sizes the probes to the engines' run, so the floor is the one that run meets."""
    from kiln.hardware.jitter import default_probes

    for target in (0.02, 0.15):  # resnet50's run and bert-base's, here
        for probe in default_probes(target_s=target):
            best = min(time_runs(probe.run, 3))
            assert target / 4 <= best <= 4 * target, (probe.work, best)


# ---------------------------------------------------------------------------- the verbs
@pytest.fixture
def cached_peaks(monkeypatch) -> Peaks:
    """Peaks in this test's KILN_HOME cache, as `kiln doctor` leaves them (and no measuring
    should a verb miss the cache)."""
    monkeypatch.setattr(peaks_module, "measure", lambda progress=None: FAKE_PEAKS)
    return measured_peaks()


def kiln(*args: str) -> dict:
    """The verb's --json, run in this process (a fresh interpreter would only add seconds)."""
    done = CliRunner().invoke(app, list(args))
    assert done.exit_code == 0, done.output
    return json.loads(done.stdout)


def test_steadiness_names_the_lowest_jitter_and_ties_within_noise():
    from kiln.bench.report import steadiness

    samples = {
        "calm": synthetic_windows(9),  # no stall at all
        "stalls": stalled_windows(5, every=50),
        "stalls-too": stalled_windows(6, every=50),  # the same tail, other draws
    }
    verdicts = steadiness(samples)
    assert verdicts["calm"]["verdict"] == "steadiest"
    assert verdicts["calm"]["jitter_ratio"] < 1 and verdicts["calm"]["vs"] in samples
    assert {verdicts[k]["verdict"] for k in ("stalls", "stalls-too")} == {"less steady"}
    without_calm = steadiness({k: v for k, v in samples.items() if k != "calm"})
    tied = [v for v in without_calm.values() if v["verdict"] != "steadiest"]
    assert len(tied) == 1 and tied[0]["verdict"] == "tied"  # same tails: noise decides
    low, high = tied[0]["interval"]
    assert low <= 1 <= high and low <= tied[0]["jitter_ratio"] <= high
    assert steadiness({"alone": samples["calm"]}) == {}


def rendered(render, data) -> str:
    console = Console(record=True, width=250)
    render(data, console)
    return console.export_text()


def test_bench_puts_each_jitter_beside_the_floor_and_reports_cqi(cached_peaks):
    args = ("zoo:resnet-tiny", "--rounds", "2", "--runs", "5", "--no-memory", "--json")
    result = kiln("bench", *args)
    floor = result["jitter_floor"]
    assert floor["floor"] == min(p["jitter"] for p in floor["probes"].values())
    assert all(p["runs"] >= 1000 for p in floor["probes"].values())
    assert "the fastest engine's run" in floor["measured"]
    assert result["p99_runs"] == 2 * 5 and result["p99_backed"] is False
    assert result["flops_per_run"] > 0
    for engine in result["engines"].values():
        assert engine["jitter_over_floor"] == pytest.approx(engine["jitter"] / floor["floor"])
        every_core = floor["probes"]["numpy-matmul"]["jitter"]
        assert engine["jitter_over_parallel_floor"] == pytest.approx(engine["jitter"] / every_core)
        low, high = engine["jitter_interval"]
        assert low <= engine["jitter"] <= high
        low, high = engine["jitter_over_floor_interval"]
        assert low <= engine["jitter_over_floor"] <= high
        assert engine["roofline_fraction"] > 0 and 0 <= engine["cqi"] <= 1
        assert engine["peak_gflops"] == cached_peaks.fp32_gflops  # fp32 engines, fp32 peak
    text = rendered(print_bench, result)
    assert "jitter (× floor)" in text and "CQI" in text
    kiln_row = result["engines"]["kiln"]
    low, high = kiln_row["jitter_over_floor_interval"]
    over = f"({kiln_row['jitter_over_floor']:.1f}×, {low:.1f}–{high:.1f})"
    assert f"{kiln_row['cqi']:.3f}" in text and over in text
    steady = result["steadiness"]["kiln"]
    assert steady["vs"] in result["engines"] and steady["vs"] != "kiln"
    assert steady["jitter_ratio"] == pytest.approx(
        kiln_row["jitter"] / result["engines"][steady["vs"]]["jitter"]
    )
    assert f"Steadiness: Kiln's jitter is {steady['jitter_ratio']:.2f}× {steady['vs']}'s" in text


def test_doctor_measures_the_floor_and_shows_it(cached_peaks):
    info = kiln("doctor", "--json")
    floor = info["jitter_floor"]
    assert floor["probe"] in floor["probes"] and "never cached" in floor["measured"]
    assert all(p["runs"] >= 1000 for p in floor["probes"].values())
    text = rendered(print_doctor, info)
    assert f"jitter floor {floor['floor']:.2f}" in text
    assert all(name in text for name in floor["probes"])


def test_a_blocks_first_run_after_another_engine_is_not_timed():
    """The run after another engine's block pays for that engine (its threads still spinning):
    interleave leaves it untimed, so no engine's tail is the switch."""
    import time

    from kiln.timing import interleave

    last = [""]

    def engine(name: str):
        def run() -> None:
            if last[0] != name:  # the switch: 50 ms of work, as a spinning pool steals
                end = time.perf_counter() + 0.05
                while time.perf_counter() < end:
                    pass
            last[0] = name

        return run

    samples = interleave({"a": engine("a"), "b": engine("b")}, rounds=4, runs=5, warmup=1)
    timed = [t for rounds in samples.values() for block in rounds for t in block]
    assert len(timed) == 2 * 4 * 5 and max(timed) < 0.025
