"""int4 quantizes the Linear layers of a plain MLP, whichever way they were exported: 2-D
MatMul + Add (which the fp32 pipeline would fuse into a Gemm) or a Gemm with its weight
transposed (torch's Linear)."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto
from onnx import helper as h
from onnx import numpy_helper as nh

import kiln
from kiln.passes.gemm_as_matmul import GemmToMatMulPass

WIDTH = 64


def mlp(path, gemm: bool) -> None:
    """Two Linear layers with a Relu between, 2-D activations."""
    rng = np.random.default_rng(0)
    nodes, inits, previous = [], [], "x"
    for i in range(2):
        weight = rng.normal(0, 0.2, (WIDTH, WIDTH)).astype(np.float32)
        bias = rng.normal(0, 0.1, WIDTH).astype(np.float32)
        inits += [nh.from_array(weight.T.copy() if gemm else weight, f"w{i}"),
                  nh.from_array(bias, f"b{i}")]  # fmt: skip
        out = "y" if i == 1 else f"h{i}"
        linear = f"l{i}" if i == 0 else "y"
        if gemm:
            nodes.append(h.make_node("Gemm", [previous, f"w{i}", f"b{i}"], [linear],
                                     name=f"fc{i}", transB=1))  # fmt: skip
        else:
            nodes.append(h.make_node("MatMul", [previous, f"w{i}"], [f"m{i}"], name=f"fc{i}"))
            nodes.append(h.make_node("Add", [f"m{i}", f"b{i}"], [linear], name=f"bias{i}"))
        if i == 0:
            nodes.append(h.make_node("Relu", [linear], [out], name="relu"))
        previous = out
    graph = h.make_graph(
        nodes, "mlp", [h.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WIDTH])],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", WIDTH])], inits,
    )  # fmt: skip
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]), str(path))


@pytest.mark.parametrize("gemm", [False, True], ids=["matmul-add", "gemm"])
def test_int4_quantizes_a_linear_layers_weights(tmp_path, gemm):
    mlp(tmp_path / "m.onnx", gemm)
    artifact = kiln.compile(tmp_path / "m.onnx", tmp_path / "m.kiln", precision="int4",
                            shapes={"x": (16, WIDTH)}, max_drop=0.05, rounds=0)  # fmt: skip
    assert artifact.manifest.verification.ok
    ops = [n.op_type for n in onnx.load(str(artifact.model_path)).graph.node]
    assert "Gemm" not in ops
    assert ops.count("MatMulNBits") + ops.count("MatMul") == 2 and "MatMulNBits" in ops


def test_gemm_with_a_constant_weight_becomes_matmul_and_add():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((3, 4)).astype(np.float32)
    model = ir.from_proto(h.make_model(h.make_graph(
        [h.make_node("Gemm", ["a", "w", "c"], ["t"], name="t0", transB=1),
         h.make_node("Gemm", ["a", "w2"], ["n"], name="n0"),
         h.make_node("Gemm", ["a", "x"], ["s"], name="s0", alpha=2.0)],  # not a constant B
        "g", [h.make_tensor_value_info("a", TensorProto.FLOAT, [3, 4]),
              h.make_tensor_value_info("x", TensorProto.FLOAT, [4, 5])],
        [h.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("t", "n", "s")],
        [nh.from_array(rng.standard_normal((5, 4)).astype(np.float32), "w"),
         nh.from_array(rng.standard_normal(5).astype(np.float32), "c"),
         nh.from_array(rng.standard_normal((4, 5)).astype(np.float32), "w2")],
    ), opset_imports=[h.make_opsetid("", 17)]))  # fmt: skip
    import onnxruntime as ort

    def run(m: ir.Model) -> list[np.ndarray]:
        proto = ir.serde.serialize_model(m).SerializeToString()
        session = ort.InferenceSession(proto, providers=["CPUExecutionProvider"])
        return session.run(None, {"a": a, "x": np.ones((4, 5), np.float32)})

    before = run(model)
    assert GemmToMatMulPass()(model).modified
    ops = sorted(node.op_type for node in model.graph)
    assert ops == ["Add", "Gemm", "MatMul", "MatMul"], ops
    for old, new in zip(before, run(model), strict=True):
        np.testing.assert_allclose(new, old, rtol=1e-5, atol=1e-5)
