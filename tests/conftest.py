"""Shared fixtures: keep Kiln's state out of the user's home during tests."""

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kiln.hardware.peaks import Peaks, cache_path, save_peaks
from kiln.passes.fused_op_pays import ENV as FUSED_OPS_ENV

# The same graphs on every machine: fusions into contrib ops are not timed against their parts
# (kiln.passes.fused_op_pays), so fusion counts do not depend on this CPU. Subprocesses inherit
# it. tests/test_fused_op_pays.py sets "measure" where it tests the measured decision.
os.environ[FUSED_OPS_ENV] = "fuse"
# The verbs' progress lines off a terminal stay off, so that stderr is the one-line error the
# tests read; tests/test_cli.py turns them on where it tests them.
os.environ["KILN_PROGRESS"] = "off"

# Every test's KILN_HOME starts with peaks cached, at fixed plausible values: the verbs that
# place work on a roofline (`kiln bench`'s CQI, `kiln profile`) would otherwise measure this
# machine's peaks (≈ 15 s) in every test. tests/test_hardware.py measures them for real, in
# homes of its own.
TEST_PEAKS = Peaks(
    fp32_gflops=150.0, bf16_gflops=None, int8_gops=300.0, bandwidth_gbs=20.0, threads=2,
    measured_at="2026-01-01T00:00:00+00:00",
)  # fmt: skip


# Modules that run alone, after the parallel run (the README's test command: `-m serial`):
# they time this machine or its memory (a training step's time split into data, compute and
# optimizer), or load it on purpose (400 requests at once against deadlines), and a second
# test worker beside them would move what they measure.
SERIAL = {
    "test_bench_memory", "test_feedback", "test_footprint", "test_hardware", "test_head_to_head",
    "test_jitter_floor", "test_serve_load", "test_steady", "test_train_profile",
}  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.module is not None and item.module.__name__.rsplit(".", 1)[-1] in SERIAL:
            item.add_marker(pytest.mark.serial)


@pytest.fixture(autouse=True)
def kiln_home(tmp_path_factory, monkeypatch):
    home = tmp_path_factory.mktemp("kiln-home")
    monkeypatch.setenv("KILN_HOME", str(home))
    save_peaks(cache_path(), TEST_PEAKS)
    return home


@pytest.fixture(scope="module")
def module_home(request: pytest.FixtureRequest, tmp_path_factory) -> Iterator[Path]:
    """KILN_HOME for a module's module-scoped servers, which outlive the per-test one above:
    a directory of their own, set while the module's fixtures are set up."""
    path = tmp_path_factory.mktemp(f"{request.module.__name__}-home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KILN_HOME", str(path))
        yield path
