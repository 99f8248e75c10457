"""int8 under the accuracy guard: the hostile layer is found, kept in fp32, the budget holds."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto
from onnx import helper as h
from onnx import numpy_helper as nh

import kiln


def hostile_model(path) -> None:
    """mm1 → a wide-range activation (one channel ×1000, which mm2 ignores) → mm2 → mm3.

    Dynamic int8 quantizes mm2's input per tensor: the outlier channel takes the whole
    uint8 range and the channels mm2 really uses round to nothing. mm1 and mm3 are benign.
    """
    rng = np.random.default_rng(0)
    w1, w2, w3 = (rng.normal(0, 0.2, (64, 64)).astype(np.float32) for _ in range(3))
    w2[0, :] = 0.0
    scale = np.ones(64, np.float32)
    scale[0] = 1000.0
    nodes = [
        h.make_node("MatMul", ["x", "w1"], ["a"], name="mm1"),
        h.make_node("Mul", ["a", "scale"], ["wide"], name="outlier"),
        h.make_node("MatMul", ["wide", "w2"], ["b"], name="mm2"),
        h.make_node("MatMul", ["b", "w3"], ["y"], name="mm3"),
    ]
    inits = [nh.from_array(v, n) for v, n in ((w1, "w1"), (w2, "w2"), (w3, "w3"), (scale, "scale"))]
    graph = h.make_graph(
        nodes,
        "hostile",
        [h.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 64])],
        inits,
    )
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]), str(path))


def test_guard_restores_exactly_the_hostile_layer(tmp_path):
    hostile_model(tmp_path / "m.onnx")
    artifact = kiln.compile(tmp_path / "m.onnx", tmp_path / "m.kiln", precision="int8",
                            shapes={"x": (16, 64)})  # fmt: skip
    manifest = artifact.manifest
    nodes = manifest["precision"]["nodes"]
    assert [n for n, p in nodes.items() if p.startswith("fp32")] == ["mm2"], nodes
    assert nodes["mm1"] == nodes["mm3"] == "int8"
    verification = manifest["verification"]
    assert verification["ok"] and verification["outputs"][0]["cosine"] >= 0.99
    ops = [n.op_type for n in onnx.load(str(artifact.model_path)).graph.node]
    assert ops.count("MatMulInteger") == 2 and ops.count("MatMul") == 1


def test_int8_without_verification_is_refused(tmp_path):
    with pytest.raises(kiln.KilnError, match="int8 is only written verified"):
        kiln.compile("zoo:bert-tiny", tmp_path / "b.kiln", precision="int8", verify=False)


def test_int8_transformer_is_quantized_and_traced(tmp_path):
    artifact = kiln.compile("zoo:bert-tiny", tmp_path / "b.kiln", precision="int8")
    assert artifact.manifest["verification"]["ok"]
    ops = {record["op_type"].split("::")[-1] for record in artifact.provenance().values()}
    assert {"MatMulInteger", "QAttention"} <= ops
    assert all(record["origin"] for record in artifact.provenance().values())


def test_conv_model_gets_static_qdq_int8_and_a_calibration_warning(tmp_path):
    import collections

    artifact = kiln.compile("zoo:resnet-tiny", tmp_path / "r.kiln", precision="int8")
    precision = artifact.manifest["precision"]
    assert precision["scheme"].startswith("static QDQ")
    assert precision["calibration"]["source"] == "synthetic"
    assert "unproven" in precision["calibration"]["warning"]
    assert artifact.manifest["verification"]["ok"]
    ops = collections.Counter(n.op_type for n in onnx.load(str(artifact.model_path)).graph.node)
    assert ops["QuantizeLinear"] > 0 and ops["DequantizeLinear"] > 0 and ops["FusedConv"] == 0


def test_static_int8_calibrates_on_the_users_inputs(tmp_path):
    x = np.random.default_rng(1).random((2, 3, 32, 32), dtype=np.float32)
    np.savez(tmp_path / "calib.npz", input=x)
    artifact = kiln.compile(
        "zoo:resnet-tiny", tmp_path / "r.kiln", precision="int8", inputs=str(tmp_path / "calib.npz")
    )
    assert artifact.manifest["precision"]["calibration"] == {"source": str(tmp_path / "calib.npz")}


def test_int8_that_needs_every_layer_in_fp32_is_refused(tmp_path):
    # One MatMul whose input has an outlier channel it ignores: no layer can stay int8.
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.2, (64, 64)).astype(np.float32)
    w[0, :] = 0.0
    scale = np.ones(64, np.float32)
    scale[0] = 1000.0
    nodes = [
        h.make_node("Mul", ["x", "scale"], ["wide"], name="outlier"),
        h.make_node("MatMul", ["wide", "w"], ["y"], name="mm"),
    ]
    graph = h.make_graph(
        nodes,
        "hopeless",
        [h.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 64])],
        [nh.from_array(w, "w"), nh.from_array(scale, "scale")],
    )
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]), str(tmp_path / "m.onnx"))
    with pytest.raises(kiln.KilnError, match="only with every layer kept in fp32"):
        kiln.compile(tmp_path / "m.onnx", tmp_path / "m.kiln", precision="int8",
                     shapes={"x": (16, 64)})  # fmt: skip
    assert not (tmp_path / "m.kiln").exists()
