"""`kiln bench` takes what the other verbs take: a saved torch.export program (.pt2) and the
artifact built from one (whose original, the .pt2, is exported again to compare against).

Needs torch; skipped cleanly without it."""

from __future__ import annotations

import pytest

import kiln
from kiln.bench.report import run_bench

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    where = tmp_path_factory.mktemp("pt2")
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(), torch.nn.Linear(4, 2),
    ).eval()  # fmt: skip
    torch.export.save(torch.export.export(model, (torch.rand(1, 3, 16, 16),)), where / "cnn.pt2")
    return where / "cnn.pt2"


# The artifact (the issue's `kiln bench cnn_pt2.kiln`) in CI; the program too with -m slow
# (each exports to ONNX again: seconds that CI's budget does not have twice).
@pytest.mark.parametrize("kind", [pytest.param("program", marks=pytest.mark.slow), "artifact"])
def test_bench_takes_a_pt2_program_and_its_artifact(program, tmp_path, kind):
    target = program
    if kind == "artifact":
        target = kiln.compile(program, tmp_path / "cnn_pt2.kiln", rounds=0).path
    result = run_bench(str(target), "ort-basic", 1, 1, 1, lambda _m: None, memory=False)
    assert result["kiln_build"]["source"].endswith("cnn.pt2")
    assert result["engines"]["kiln"]["cosine_vs_fp32"] > 0.999
