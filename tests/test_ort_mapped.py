"""A large model from a file compiles on one resident copy of its weights: every ONNX Runtime
session a compile opens uses the file's one memory map, and still computes what ONNX Runtime
computes from the file itself."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from mlp_models import write_mlp

import kiln
from kiln.backends import get_backend, ort_mapped
from kiln.backends.ort import OrtOptions

WIDTH = 128


@pytest.fixture
def large(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every external-data model counts as large."""
    monkeypatch.setattr(ort_mapped, "SHARE_MAPPED_BYTES", 1)


def test_sessions_share_the_files_one_map_and_compute_what_ort_does(
    tmp_path: Path, large: None
) -> None:
    path = write_mlp(tmp_path / "mlp.onnx", 3, width=WIDTH)
    x = np.random.default_rng(1).standard_normal((2, WIDTH)).astype(np.float32)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    # Two loads of the model: distinct tensor objects, as a pass that copies the model makes.
    first = get_backend("ort").compile(ir.load(path), OrtOptions())
    second = get_backend("ort").compile(ir.load(path), OrtOptions(optimization="all"))
    pointers = [
        {n: v.data_ptr() for n, v in e.session._kiln_mapped.items()} for e in (first, second)
    ]
    assert pointers[0] == pointers[1] and len(pointers[0]) == 3  # one copy, shared
    for executable in (first, second):
        got = executable.run({"x": x})
        np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    assert np.abs(want[0]).max() > 0  # a placeholder's zeros would not pass for the weights


def test_small_external_models_keep_a_session_of_their_own(tmp_path: Path) -> None:
    path = write_mlp(tmp_path / "mlp.onnx", 3, width=WIDTH)
    executable = get_backend("ort").compile(ir.load(path), OrtOptions())
    assert not hasattr(executable.session, "_kiln_mapped")  # prepacked weights run faster


def test_a_large_model_compiles_verified_and_its_artifact_matches(
    tmp_path: Path, large: None
) -> None:
    path = write_mlp(tmp_path / "mlp.onnx", 3, width=WIDTH)
    artifact = kiln.compile(str(path), tmp_path / "mlp.kiln", rounds=0)
    assert artifact.manifest.verification.ok
    x = np.random.default_rng(2).standard_normal((3, WIDTH)).astype(np.float32)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    got = kiln.Session(str(artifact.path)).run(None, {"x": x})
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
