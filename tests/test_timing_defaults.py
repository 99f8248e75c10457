"""`kiln.compile` times its artifact as `kiln optimize` does: one default, in TimingConfig."""

from __future__ import annotations

import inspect

import kiln
from kiln.cli.optimize import optimize
from kiln.config import TIMING


def test_kiln_compile_and_kiln_optimize_time_alike_by_default():
    python = inspect.signature(kiln.compile).parameters
    cli = inspect.signature(optimize).parameters
    for name in ("rounds", "runs"):
        assert python[name].default == cli[f"timing__{name}"].default == getattr(TIMING, name)
    assert TIMING.rounds > 0


def test_kiln_compile_records_a_benchmark_by_default(tmp_path):
    artifact = kiln.compile("zoo:resnet-tiny", tmp_path / "m.kiln", runs=2)
    benchmark = artifact.manifest.benchmark
    assert benchmark is not None and benchmark.get("rounds") == TIMING.rounds
    assert kiln.compile("zoo:resnet-tiny", tmp_path / "n.kiln", rounds=0).manifest.benchmark is None
