"""The compile pipeline end to end on the tiny zoo: verified, traced, loadable, runnable."""

from __future__ import annotations

import collections
import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto
from onnx import helper as h

import kiln
from kiln import zoo
from kiln.backends import get_backend
from kiln.backends.ort import OrtOptions
from kiln.ir.inputs import synthesize
from kiln.passes import KilnPass, PassSpec, default_pipeline
from kiln.zoo import bert, gpt2, vit

TINY = [n for n in zoo.names() if zoo.entry(n).tiny]
LAYERS = {"bert-tiny": bert.TINY.layers, "gpt2-tiny": gpt2.TINY.layers, "vit-tiny": vit.TINY.layers}


def op_counts(model_path) -> collections.Counter:
    graph = onnx.load(str(model_path)).graph
    return collections.Counter(n.op_type for n in graph.node)


def reference(model: onnx.ModelProto, feeds):
    exe = get_backend("ort").compile(ir.serde.deserialize_model(model), OrtOptions("basic"))
    return exe.run(feeds)


@pytest.mark.parametrize("name", TINY)
def test_tiny_zoo_compiles_verified_traced_and_runs(name, tmp_path):
    artifact = kiln.compile(f"zoo:{name}", tmp_path / f"{name}.kiln", rounds=0)
    manifest = json.loads((artifact.path / "manifest.json").read_text())
    assert manifest["verification"]["ok"]
    assert manifest["source"]["path"] == f"zoo:{name}"

    original = zoo.build(name)
    original_names = {n.name for n in original.graph.node}
    provenance = artifact.provenance()
    assert provenance, "provenance.json is empty"
    for node, record in provenance.items():
        assert record["origin"], f"compiled node {node} traces to no original node"
        assert set(record["origin"]) <= original_names, f"{node}: unknown origin"

    feeds = synthesize(ir.serde.deserialize_model(original), seed=1)
    expected = reference(original, feeds)
    got = kiln.Session(artifact.path).run(None, feeds)
    for want, have in zip(expected, got, strict=True):
        np.testing.assert_allclose(have, want, rtol=1e-3, atol=1e-4 * max(1, np.abs(want).max()))


@pytest.mark.parametrize(
    ("name", "fused"),
    [
        # per layer: one attention; a residual+LayerNorm after attention and after the FFN
        # (GPT-2 is pre-norm: the second is the next layer's ln_1 or ln_f); one GELU
        ("bert-tiny", {"Attention": 1, "SkipLayerNormalization": 2, "BiasGelu": 1}),
        ("gpt2-tiny", {"Attention": 1, "SkipLayerNormalization": 2, "FastGelu": 1}),
        ("vit-tiny", {"Attention": 1, "SkipLayerNormalization": 1, "BiasGelu": 1}),
    ],
)
def test_transformers_come_out_with_attention_fused(name, fused, tmp_path):
    layers = LAYERS[name]
    artifact = kiln.compile(f"zoo:{name}", tmp_path / "out.kiln", rounds=0)
    counts = op_counts(artifact.model_path)
    for op, each in fused.items():
        count = each * layers
        assert counts[op] == count, f"{name}: expected {count} {op}, got {counts}"
    assert counts["Softmax"] == 0, "an attention block was left unfused"


def test_gpt2_attention_is_causal(tmp_path):
    artifact = kiln.compile("zoo:gpt2-tiny", tmp_path / "out.kiln", rounds=0)
    graph = onnx.load(str(artifact.model_path)).graph
    attention = [n for n in graph.node if n.op_type == "Attention"]
    assert all(any(a.name == "unidirectional" and a.i == 1 for a in n.attribute) for n in attention)


class BreakAdd(KilnPass):
    """A deliberately wrong pass: turns the first Add into a Sub."""

    name = "break-add"
    stage = "fuse"
    summary = "deliberately wrong"

    def apply(self, model: ir.Model) -> int:
        for node in model.graph:
            if node.op_type == "Add":
                node.op_type = "Sub"
                return 1
        return 0


def test_bisection_finds_and_drops_a_wrong_pass(tmp_path):
    pipeline = default_pipeline()
    planted = PassSpec("break-add", "fuse", BreakAdd, "deliberately wrong")
    pipeline.insert(3, planted)
    artifact = kiln.compile("zoo:bert-tiny", tmp_path / "out.kiln", pipeline=pipeline, rounds=0)
    manifest = artifact.manifest
    assert manifest.dropped_passes == ["break-add"]
    assert manifest.verification.ok
    assert "break-add" not in {p.name for p in manifest.passes}
    assert op_counts(artifact.model_path)["Attention"] == LAYERS["bert-tiny"], (
        "other passes must still run"
    )


def messy_model() -> onnx.ModelProto:
    """Control flow with subgraphs, a com.microsoft op, weights as Constant nodes, opset 13."""
    weight = h.make_tensor("w", TensorProto.FLOAT, [4, 4], np.eye(4, dtype=np.float32).ravel())
    then_branch = h.make_graph(
        [h.make_node("Relu", ["mm"], ["then_out"], name="then.relu")],
        "then",
        [],
        [h.make_tensor_value_info("then_out", TensorProto.FLOAT, ["batch", 4])],
    )
    else_branch = h.make_graph(
        [
            h.make_node("Identity", ["mm"], ["id"], name="else.identity"),
            h.make_node("Neg", ["id"], ["else_out"], name="else.neg"),
        ],
        "else",
        [],
        [h.make_tensor_value_info("else_out", TensorProto.FLOAT, ["batch", 4])],
    )
    nodes = [
        h.make_node("Constant", [], ["w"], name="weight.const", value=weight),
        h.make_node("MatMul", ["x", "w"], ["mm"], name="matmul"),
        h.make_node("ReduceSum", ["x"], ["s"], name="sum", keepdims=0),
        h.make_node("Greater", ["s", "zero"], ["cond_v"], name="greater"),
        h.make_node("Squeeze", ["cond_v"], ["cond"], name="squeeze"),
        h.make_node(
            "If", ["cond"], ["branch"], name="if", then_branch=then_branch, else_branch=else_branch
        ),
        h.make_node("Gelu", ["branch"], ["y"], name="ms.gelu", domain="com.microsoft"),
    ]
    graph = h.make_graph(
        nodes,
        "messy",
        [h.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [h.make_tensor("zero", TensorProto.FLOAT, [], [0.0])],
    )
    opsets = [h.make_opsetid("", 13), h.make_opsetid("com.microsoft", 1)]
    return h.make_model(graph, opset_imports=opsets)


def test_control_flow_contrib_ops_and_constant_weights_pass_through(tmp_path):
    path = tmp_path / "messy.onnx"
    onnx.save(messy_model(), str(path))
    artifact = kiln.compile(path, tmp_path / "messy.kiln", rounds=0)
    assert artifact.manifest.verification.ok
    session = kiln.Session(artifact.path)
    for sign in (1.0, -1.0):
        x = sign * np.arange(1, 5, dtype=np.float32).reshape(1, 4)
        (y,) = session.run(None, {"x": x})
        (want,) = reference(messy_model(), {"x": x})
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    counts = op_counts(artifact.model_path)
    assert counts["If"] == 1 and counts["Gelu"] == 1


def test_session_rejects_wrong_input_naming_it(tmp_path):
    artifact = kiln.compile("zoo:resnet-tiny", tmp_path / "r.kiln", rounds=0)
    session = kiln.Session(artifact.path)
    with pytest.raises(kiln.KilnError, match=r"unknown input 'wrong'; the model's inputs are"):
        session.run(None, {"wrong": np.zeros((1, 3, 32, 32), np.float32)})


def test_unverified_compile_is_marked(tmp_path):
    artifact = kiln.compile("zoo:resnet-tiny", tmp_path / "r.kiln", verify=False, rounds=0)
    assert artifact.manifest.verification is None


def test_external_data_model_compiles_and_artifact_runs(tmp_path):
    proto = zoo.build("resnet-tiny")
    path = tmp_path / "ext.onnx"
    onnx.save(
        proto, str(path), save_as_external_data=True, location="ext.onnx.data", size_threshold=0
    )
    assert (tmp_path / "ext.onnx.data").stat().st_size > 0
    artifact = kiln.compile(path, tmp_path / "ext.kiln", rounds=0)
    assert artifact.manifest.verification.ok
    proto = zoo.build("resnet-tiny")  # onnx.save moved the weights out of the first one
    feeds = synthesize(ir.serde.deserialize_model(proto))
    np.testing.assert_allclose(
        kiln.Session(artifact.path).run(None, feeds)[0], reference(proto, feeds)[0], rtol=1e-4
    )


def test_opset_11_model_passes_through(tmp_path):
    nodes = [
        h.make_node("Unsqueeze", ["x"], ["u"], name="unsqueeze", axes=[0]),  # opset-11 form
        h.make_node("Squeeze", ["u"], ["s"], name="squeeze", axes=[0]),
        h.make_node("Relu", ["s"], ["y"], name="relu"),
    ]
    graph = h.make_graph(
        nodes,
        "old",
        [h.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
    )
    path = tmp_path / "old.onnx"
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 11)]), str(path))
    artifact = kiln.compile(path, tmp_path / "old.kiln", rounds=0)
    assert artifact.manifest.verification.ok
    x = np.array([[-1, 2, -3], [4, -5, 6]], np.float32)
    np.testing.assert_allclose(kiln.Session(artifact.path).run(None, {"x": x})[0], np.maximum(x, 0))


class CrashingPass(KilnPass):
    """A pass with a bug: it raises."""

    name = "crash"
    stage = "fuse"
    summary = "raises"

    def apply(self, model: ir.Model) -> int:
        raise RuntimeError("boom")


def test_a_crashing_pass_is_dropped_not_fatal(tmp_path):
    pipeline = default_pipeline()
    pipeline.insert(2, PassSpec("crash", "fuse", CrashingPass, "raises"))
    artifact = kiln.compile("zoo:gpt2-tiny", tmp_path / "out.kiln", pipeline=pipeline, rounds=0)
    assert artifact.manifest.dropped_passes == ["crash"]
    assert artifact.manifest.verification.ok


def test_openvino_artifact_runs_with_its_recorded_engine(tmp_path):
    pytest.importorskip("openvino")
    artifact = kiln.compile("zoo:resnet-tiny", tmp_path / "ov.kiln", backend="openvino", rounds=0)
    manifest = artifact.manifest
    assert manifest.backend.name == "openvino"
    assert manifest.backend.options["inference_precision"] == "f32"
    assert manifest.verification.ok
    ops = op_counts(artifact.model_path)
    assert not any(op in ops for op in ("FusedConv", "Attention")), "ORT-only ops leaked"
    session = kiln.Session(artifact.path)
    assert type(session.executable).__name__ == "OpenVinoExecutable"
    proto = zoo.build("resnet-tiny")
    feeds = synthesize(ir.serde.deserialize_model(proto), seed=3)
    np.testing.assert_allclose(session.run(None, feeds)[0], reference(proto, feeds)[0], atol=1e-4)


def test_bf16_artifact_is_verified_by_cosine(tmp_path):
    ov = pytest.importorskip("openvino")
    if "BF16" not in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        pytest.skip("this CPU has no bf16")
    artifact = kiln.compile(
        "zoo:bert-tiny", tmp_path / "b.kiln", backend="openvino", precision="bf16", rounds=0
    )
    manifest = artifact.manifest
    assert manifest.precision["default"] == "bf16"
    assert manifest.backend.options["inference_precision"] == "bf16"
    verification = manifest.verification
    assert verification.ok and verification.precision == "bf16"
    assert all(o.cosine >= 0.99 for o in verification.outputs)


def test_bf16_on_onnxruntime_is_refused_with_the_way_out(tmp_path):
    with pytest.raises(kiln.KilnError, match="precision bf16 runs on openvino here, not ort"):
        kiln.compile("zoo:bert-tiny", tmp_path / "b.kiln", precision="bf16", rounds=0)


def test_bf16_that_drifts_is_refused_without_blaming_a_pass(tmp_path):
    ov = pytest.importorskip("openvino")
    if "BF16" not in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        pytest.skip("this CPU has no bf16")
    rng = np.random.default_rng(0)
    w1 = (1.0 + 1e-3 * rng.random((64, 64))).astype(np.float32)  # differs from w2 below bf16's
    w2 = np.ones((64, 64), np.float32)  # 8-bit mantissa: the difference is all rounding
    nodes = [
        h.make_node("MatMul", ["x", "w1"], ["a"], name="a"),
        h.make_node("MatMul", ["x", "w2"], ["b"], name="b"),
        h.make_node("Sub", ["a", "b"], ["y"], name="sub"),
    ]
    graph = h.make_graph(
        nodes,
        "cancel",
        [h.make_tensor_value_info("x", TensorProto.FLOAT, [4, 64])],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, [4, 64])],
        [onnx.numpy_helper.from_array(w1, "w1"), onnx.numpy_helper.from_array(w2, "w2")],
    )
    path = tmp_path / "cancel.onnx"
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]), str(path))
    with pytest.raises(
        kiln.KilnError, match=r"at bf16 the outputs drift too far \(output 'y' cosine"
    ):
        kiln.compile(path, tmp_path / "c.kiln", backend="openvino", precision="bf16", rounds=0)
    assert not (tmp_path / "c.kiln").exists()
