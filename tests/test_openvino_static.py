"""OpenVINO specialized to a shape: an executable compiled static at `dim_overrides` answers
every other shape through a dynamic compile made on first need; `kiln optimize --static`
writes such an artifact and a Session keeps its shape; `kiln tune` searches it."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import pytest
from typer.testing import CliRunner

import kiln
from kiln import zoo
from kiln.backends.openvino import OpenVinoBackend, OpenVinoOptions
from kiln.cli import app
from kiln.compiler.select import candidates
from kiln.config import CompileConfig
from kiln.ir.inputs import feed_dims, synthesize
from kiln.tune.objectives import parse_objectives
from kiln.tune.space import Space, choice_of, default_params, project

pytest.importorskip("openvino")

STATIC = {"batch": 1, "seq": 16}


@pytest.fixture(scope="module")
def model() -> ir.Model:
    return ir.serde.deserialize_model(zoo.build("bert-tiny"))


def _static(exe) -> bool:
    return all(port.get_partial_shape().is_static for port in exe.compiled.inputs)


def test_a_static_compile_answers_its_shape_and_every_other_through_the_dynamic_one(model):
    backend = OpenVinoBackend()
    fixed = backend.compile(model, OpenVinoOptions(inference_precision="f32", dim_overrides=STATIC))
    free = backend.compile(model, OpenVinoOptions(inference_precision="f32"))
    assert _static(fixed) and not _static(free)
    for dims in (STATIC, {"batch": 2, "seq": 8}):
        feeds = synthesize(model, dims)
        for got, want in zip(fixed.run(feeds), free.run(feeds), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert not _static(fixed.dynamic())


def test_a_static_compile_still_refuses_what_no_shape_makes_right(model):
    fixed = OpenVinoBackend().compile(model, OpenVinoOptions(dim_overrides=STATIC))
    feeds = synthesize(model, STATIC)
    with pytest.raises(kiln.KilnError, match="must be int64, got int32"):
        fixed.run({k: v.astype(np.int32) for k, v in feeds.items()})
    with pytest.raises(kiln.KilnError, match="missing input"):
        fixed.run({k: v for k, v in list(feeds.items())[1:]})
    with pytest.raises(kiln.KilnError, match="invalid inputs"):  # a wrong rank: no dims fit
        fixed.run({k: v[None] for k, v in feeds.items()})


def test_optimize_static_fixes_the_verified_dims_and_a_session_keeps_them(tmp_path):
    done = CliRunner().invoke(app, ["optimize", "zoo:bert-tiny", "--backend", "openvino",
                                    "--static", "--rounds", "0", "-o", str(tmp_path / "s.kiln"),
                                    "--json"])  # fmt: skip
    assert done.exit_code == 0, done.output
    manifest = json.loads((tmp_path / "s.kiln" / "manifest.json").read_text())
    assert manifest["backend"]["options"]["dim_overrides"] == STATIC
    session = kiln.Session(tmp_path / "s.kiln")
    assert _static(session.executable)
    feeds = synthesize(ir.load(str(tmp_path / "s.kiln" / "model.onnx")), {"batch": 3, "seq": 8})
    assert session.run(None, feeds)[0].shape[:2] == (3, 8)


def test_auto_keeps_static_for_openvino_only_and_onnx_runtime_refuses_it():
    configs = candidates(CompileConfig(engine="auto", precision="auto", static=True))
    assert {c.engine for c in configs if c.static} == {"openvino"}
    assert not any(c.static for c in configs if c.engine == "ort")
    assert not any(c.static for c in candidates(CompileConfig(engine="auto", precision="auto")))
    with pytest.raises(kiln.KilnError, match="--static applies to OpenVINO"):
        CompileConfig(engine="ort", static=True)


def test_tune_searches_openvino_static_at_the_dims_each_trial_is_timed_at(model):
    from kiln.ir.load import load_model
    from kiln.tune.bench import Workbench

    space = Space(("ort", "openvino"), ("fp32", "int8"), cores=2)
    assert default_params(space, "openvino", "fp32")["openvino.static"] is False
    assert "openvino.static" not in default_params(space, "ort", "fp32")
    params = default_params(space, "openvino", "fp32") | {"openvino.static": True}
    assert project(params, space, model, CompileConfig())["openvino.static"] is True
    choice = choice_of(params, space, model, CompileConfig())
    bench = Workbench(load_model("zoo:bert-tiny"), CompileConfig(), parse_objectives(["latency"]),
                      [], 0.3)  # fmt: skip
    built = bench.build(choice)
    assert built.result.options.dim_overrides == feed_dims(model, built.feeds) == STATIC
    built.runners[0]()
    throughput = Space(("openvino",), ("fp32",), cores=2, throughput=True)
    assert "openvino.static" not in default_params(throughput, "openvino", "fp32")


def test_auto_with_pinned_dims_also_times_each_openvino_candidate_static():
    pinned = candidates(CompileConfig(engine="auto", shapes={"seq": 16}))
    assert [(c.engine, c.static) for c in pinned] == [("ort", False), ("openvino", False),
                                                      ("openvino", True)]  # fmt: skip
    assert not any(c.static for c in candidates(CompileConfig(engine="auto")))  # Kiln's guess
    assert len(candidates(CompileConfig(engine="openvino", shapes={"seq": 16}))) == 1  # named
    every = candidates(CompileConfig(engine="auto", precision="auto", shapes={"seq": 16}))
    assert {c.precision for c in every if c.static} == {"fp32", "bf16"}  # no second calibration


def test_an_auto_compile_at_pinned_dims_says_which_openvino_form_it_kept(tmp_path):
    kiln.compile("zoo:bert-tiny", tmp_path / "a.kiln", backend="auto", shapes={"seq": 16},
                 rounds=3, runs=2)  # fmt: skip
    manifest = json.loads((tmp_path / "a.kiln" / "manifest.json").read_text())
    bench = manifest["benchmark"]
    assert {"ort/fp32", "openvino/fp32", "openvino/fp32 static"} <= set(bench["candidates"])
    fixed = manifest["backend"]["options"].get("dim_overrides")
    assert bool(fixed) == (bench["choice"] == "openvino/fp32 static")
    assert fixed in (None, {}, STATIC)
