"""kiln.runtime.footprint.measure_phases: the one definition of a model's memory in a process
of its own (baseline, each phase's peak above it, steady after)."""

from __future__ import annotations

import mmap
import sys

import numpy as np
import pytest

from kiln.runtime.footprint import measure_phases, reset_peak

MIB = 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM and clear_refs")
def test_each_phase_has_its_own_peak_above_the_baseline():
    held: list[mmap.mmap] = []

    def pages(mib: int) -> mmap.mmap:  # memory of its own, touched: a heap a big process
        block = mmap.mmap(-1, mib * MIB)  # left free (the forked test runner's) is not
        np.frombuffer(block, np.uint8)[:] = 1
        return block

    def load() -> None:  # 160 MiB at once, of which 40 stay
        passing = pages(120)
        held.append(pages(40))
        passing.close()

    def run() -> None:  # 20 MiB more for a moment
        pages(20).close()

    got = measure_phases({"load": load, "run": run})
    assert set(got) == {"peak_rss_mib", "steady_rss_mib", "baseline_mib",
                        "run_peak_includes_load"}  # fmt: skip
    assert got["run_peak_includes_load"] is not reset_peak()
    peaks = got["peak_rss_mib"]
    assert 150 < peaks["load"] < 200, got
    assert 50 < peaks["run"] < 100, got  # what load kept plus its own, not load's peak
    assert 30 < got["steady_rss_mib"] < 60 and got["baseline_mib"] > 0, got
