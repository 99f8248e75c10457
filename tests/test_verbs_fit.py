"""Every verb runs a model whose input leaves a dim to guess: `x[batch, n] @ W[64, 10]` runs
only at n=64, which `kiln optimize` finds on the ladder and the artifact records in its `dims`;
profile, bench, debug and compare, of the model and of its artifact, fit the same inputs."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper
from test_profile import PEAKS

import kiln
from kiln.bench.report import run_bench
from kiln.debug import compare
from kiln.debug.session import DebugSession
from kiln.profile import profile_model
from kiln.profile.target import load_target, target_feeds

WIDTH = 64  # the rows of W: the only n the model runs at


def matmul(n: str = "n") -> onnx.ModelProto:
    """x[batch, n] @ W[64, 10]; `n` "" leaves the dim unnamed."""
    weight = np.random.default_rng(0).random((WIDTH, 10), dtype=np.float32)
    graph = h.make_graph(
        [h.make_node("MatMul", ["x", "W"], ["y"], name="mm")], "mm",
        [h.make_tensor_value_info("x", T.FLOAT, ["batch", n or None])],
        [h.make_tensor_value_info("y", T.FLOAT, ["batch", 10])],
        [numpy_helper.from_array(weight, "W")],
    )  # fmt: skip
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """mm.onnx and the artifact kiln optimize builds from it."""
    where = tmp_path_factory.mktemp("fit")
    onnx.save(matmul(), where / "mm.onnx")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KILN_HOME", str(where / "home"))
        kiln.compile(where / "mm.onnx", where / "mm.kiln", rounds=0)
    return where


def shapes(feeds: dict) -> dict[str, list[int]]:
    return {name: list(np.shape(value)) for name, value in feeds.items()}


def test_the_artifact_records_the_fitted_dims(files):
    manifest = json.loads((files / "mm.kiln" / "manifest.json").read_text())
    assert manifest["dims"]["n"] == WIDTH
    model = onnx.load(str(files / "mm.kiln" / "model.onnx"))  # kiln.Session reads it there
    assert json.loads({p.key: p.value for p in model.metadata_props}["kiln.dims"])["n"] == WIDTH


def test_an_unnamed_dim_is_recorded_by_input_and_axis(tmp_path):
    onnx.save(matmul(n=""), tmp_path / "u.onnx")
    artifact = kiln.compile(tmp_path / "u.onnx", tmp_path / "u.kiln", rounds=0)
    assert artifact.manifest.dims["x[1]"] == WIDTH
    feeds = target_feeds(load_target(str(tmp_path / "u.kiln")))
    assert shapes(feeds) == {"x": [1, WIDTH]}


@pytest.mark.parametrize("name", ["mm.onnx", "mm.kiln"])
def test_profile_fits_the_inputs(files, name):
    result = profile_model(str(files / name), batch=3, runs=1, rounds=1, peaks=PEAKS)
    assert result["inputs"] == {"x": [3, WIDTH]}


@pytest.mark.parametrize("name", ["mm.onnx", "mm.kiln"])
def test_bench_fits_the_inputs(files, name):
    result = run_bench(str(files / name), "ort-basic", 2, 1, 1, lambda _m: None, memory=False)
    assert set(result["engines"]) == {"ort-basic", "kiln"}
    assert result["engines"]["kiln"]["cosine_vs_fp32"] > 0.999


@pytest.mark.parametrize("name", ["mm.onnx", "mm.kiln"])
def test_debug_fits_the_inputs(files, name):
    session = DebugSession(str(files / name), profile_runs=0)
    assert {t["name"]: t["shape"] for t in session.inputs_json()["tensors"]} == {"x": [1, WIDTH]}
    session.reseed(5)  # another seed, the same fitted shapes
    assert shapes(session.feeds) == {"x": [1, WIDTH]}


def test_compare_fits_the_inputs(files):
    result = compare(str(files / "mm.onnx"), str(files / "mm.kiln"))
    assert shapes(result.feeds) == {"x": [1, WIDTH]} and result.first is None


def test_what_no_guess_runs_is_one_error_naming_the_dim(tmp_path):
    model = ir.serde.deserialize_model(matmul())
    model.graph.initializers["W"].const_value = ir.tensor(np.ones((7777, 10), np.float32))
    ir.save(model, tmp_path / "odd.onnx")
    with pytest.raises(kiln.KilnError) as info:
        profile_model(str(tmp_path / "odd.onnx"), runs=1, rounds=1, peaks=PEAKS)
    assert "Unresolved: dim n" in str(info.value) and "--shape n=N" in str(info.value)
