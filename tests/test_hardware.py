"""kiln.hardware: measured peaks are plausible for a CPU, cached per machine, and survive a
corrupt cache; `kiln doctor` shows them."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from kiln.hardware import Peaks, cpu_info, measured_peaks
from kiln.hardware import peaks as peaks_module

FAKE = Peaks(100.0, None, 400.0, 20.0, 2, "2026-01-01T00:00:00+00:00")


@pytest.fixture(autouse=True)
def no_cached_peaks() -> None:
    """These tests are about measuring and caching: none starts with conftest's peaks."""
    peaks_module.cache_path().unlink()


@pytest.fixture(scope="module")
def shared_home(tmp_path_factory):
    """One KILN_HOME for the tests that need a real measurement: it is made only once."""
    return tmp_path_factory.mktemp("peaks-home")


@pytest.fixture
def measured(shared_home, monkeypatch) -> Peaks:
    monkeypatch.setenv("KILN_HOME", str(shared_home))
    return measured_peaks()


@pytest.fixture
def fake_measure(monkeypatch) -> list[int]:
    """Replace the measurement by FAKE; the list counts the calls."""
    calls: list[int] = []

    def measure(progress=None) -> Peaks:
        calls.append(1)
        return FAKE

    monkeypatch.setattr(peaks_module, "measure", measure)
    return calls


def test_measured_peaks_are_plausible_for_a_cpu(shared_home, monkeypatch) -> None:
    monkeypatch.setenv("KILN_HOME", str(shared_home))
    peaks = measured_peaks(refresh=True)
    cores = cpu_info().physical_cores
    assert peaks.threads == cores
    # Loose bounds: the machine is shared, so a measurement may come out low.
    assert 5 < peaks.fp32_gflops < 2_000 * cores
    assert 1 < peaks.bandwidth_gbs < 1_000
    if peaks.int8_gops is not None:
        assert 5 < peaks.int8_gops < 20_000 * cores
    has_bf16 = {"avx512_bf16", "amx_bf16"} & set(cpu_info().features)
    if not has_bf16:
        assert peaks.bf16_gflops is None
    if peaks.bf16_gflops is not None:
        assert 5 < peaks.bf16_gflops < 20_000 * cores
    assert Peaks.from_json(json.loads(json.dumps(peaks.to_json()))) == peaks
    # the caches this machine has are measured; the hierarchy gets slower as it gets bigger
    caches = cpu_info().caches
    assert (peaks.l2_bytes is not None) == ("L2" in caches)
    levels = peaks.memory_levels()
    assert levels[-1] == ("DRAM", None, peaks.bandwidth_gbs)
    sizes = [size for _, size, _ in levels[:-1]]
    assert sizes == sorted(sizes) and all(size > 0 for size in sizes)
    speeds = [speed for _, _, speed in levels]
    assert speeds == sorted(speeds, reverse=True)


@pytest.mark.slow
def test_a_measurement_takes_seconds_not_minutes() -> None:
    start = time.perf_counter()
    peaks_module.measure()
    took = time.perf_counter() - start
    assert took < 40, took  # ≤ 20 s by design; the slack is for a loaded, shared machine


def test_cache_lives_under_kiln_home(tmp_path, monkeypatch, fake_measure) -> None:
    monkeypatch.setenv("KILN_HOME", str(tmp_path))
    measured_peaks()
    assert peaks_module.cache_path() == tmp_path / "hardware" / f"{cpu_info().fingerprint}.json"
    assert json.loads(peaks_module.cache_path().read_text())["peaks"] == FAKE.to_json()


def test_second_call_reads_the_cache(measured, fake_measure) -> None:
    path = peaks_module.cache_path()
    assert json.loads(path.read_text())["fingerprint"] == cpu_info().fingerprint
    assert measured_peaks() == measured
    assert fake_measure == []  # nothing was measured again


def test_refresh_measures_again(fake_measure) -> None:
    assert measured_peaks() == FAKE
    assert measured_peaks() == FAKE
    assert measured_peaks(refresh=True) == FAKE
    assert len(fake_measure) == 2


@pytest.mark.parametrize(
    "text",
    [
        "",
        "{not json",
        "[1, 2]",
        '{"fingerprint": "FP", "peaks": {"fp32_gflops": -1}}',
        '{"fingerprint": "FP", "peaks": {"fp32_gflops": "fast", "bf16_gflops": null, '
        '"int8_gops": null, "bandwidth_gbs": 10, "threads": 2, "measured_at": "x"}}',
        '{"fingerprint": "another machine", "peaks": PEAKS}',
    ],
)
def test_corrupt_or_foreign_cache_is_measured_again(text, fake_measure) -> None:
    path = peaks_module.cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    good = json.dumps(Peaks(1.0, None, None, 1.0, 1, "x").to_json())
    path.write_text(text.replace("FP", cpu_info().fingerprint).replace("PEAKS", good))
    assert measured_peaks() == FAKE
    assert fake_measure == [1]
    assert Peaks.from_json(json.loads(path.read_text())["peaks"]) == FAKE  # rewritten whole
    assert not list(path.parent.glob("*.tmp"))


def test_cache_without_optional_fields_is_read(fake_measure) -> None:
    path = peaks_module.cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    old = {k: v for k, v in FAKE.to_json().items() if k != "load_average"}
    path.write_text(json.dumps({"fingerprint": cpu_info().fingerprint, "peaks": old}))
    assert measured_peaks() == FAKE and fake_measure == []


def test_cache_without_cache_ceilings_is_measured_again(fake_measure) -> None:
    """A cache written before L2/L3 were measured has no cache ceilings to give the roofline
    (and GEMM peaks of one engine only): it is measured over, not half-trusted."""
    path = peaks_module.cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    old = {k: v for k, v in FAKE.to_json().items() if not k.startswith(("l2_", "l3_"))}
    path.write_text(json.dumps({"fingerprint": cpu_info().fingerprint, "peaks": old}))
    assert measured_peaks() == FAKE and fake_measure == [1]
    assert "l2_bandwidth_gbs" in json.loads(path.read_text())["peaks"]


def test_cache_ceilings_never_rank_below_the_level_above() -> None:
    # a noisy measurement of L3 above L2, or of a cache below memory, is not a hierarchy
    noisy = Peaks(100.0, None, None, 30.0, 2, "x", None, 1 << 20, 50.0, 8 << 20, 60.0)
    assert noisy.memory_levels() == [
        ("L2", 1 << 20, 60.0),
        ("L3", 8 << 20, 60.0),
        ("DRAM", None, 30.0),
    ]
    slow = Peaks(100.0, None, None, 30.0, 2, "x", None, 1 << 20, 20.0, None, None)
    assert slow.memory_levels() == [("L2", 1 << 20, 30.0), ("DRAM", None, 30.0)]


def test_unwritable_home_still_gives_peaks(tmp_path, monkeypatch, fake_measure) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("KILN_HOME", str(blocker))
    assert measured_peaks() == FAKE


def test_doctor_shows_the_peaks(measured, tmp_path) -> None:
    """`measured` leaves the cache in KILN_HOME, which the `kiln` process inherits."""
    run = [sys.executable, "-m", "kiln", "doctor"]
    out = subprocess.run([*run, "--json"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["peaks"] == measured.to_json()
    table = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True)
    assert table.returncode == 0, table.stderr
    assert "peak fp32" in table.stdout and "GB/s" in table.stdout
    # the cache ceilings the roofline uses are shown with the DRAM bandwidth
    assert "memory ceilings" in table.stdout and "DRAM" in table.stdout
    if measured.l2_bandwidth_gbs:
        assert f"{measured.l2_bytes / 2**20:g} MiB" in table.stdout


def test_doctor_says_when_other_processes_took_the_cores_while_peaks_were_measured() -> None:
    from rich.console import Console

    from kiln.report.terminal import print_doctor

    start, end = (0.0, 10.0, 1.0), (2.0, 13.0, 2.0)  # 3 busy core-seconds, 1 of them ours
    assert peaks_module.others_busy(start, end, cores=2) == pytest.approx(0.5)
    assert peaks_module.others_busy(start, (2.0, 11.0, 2.0), cores=2) == 0.0  # all ours
    assert peaks_module.others_busy(None, end, cores=2) is None
    reading = peaks_module._cpu_seconds()
    assert reading is None or reading[1] > 0  # Linux: /proc/stat read
    cpu = {"model": "m", "physical_cores": 2, "logical_cores": 2, "features": []}
    info = {"python": "3", "kiln": "0", "platform": "p", "engines": {}, "cpu": cpu}
    for others, flagged in ((0.5, True), (0.05, False)):
        console = Console(record=True, width=300)
        peaks = {**FAKE.to_json(), "load_average": 3.0, "others_busy": others}
        print_doctor({**info, "peaks": peaks}, console)
        assert ("other processes took 50% of the cores" in console.export_text()) is flagged
