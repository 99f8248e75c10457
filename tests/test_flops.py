"""kiln.cost.flops: matrix-product FLOPs from shapes, checked by hand and against published
figures; one counter with kiln.cost.node_costs."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from kiln import zoo
from kiln.cost import node_costs
from kiln.cost.flops import count_flops, count_flops_by_node, count_flops_by_op
from kiln.errors import KilnError


def _model(nodes, inputs, outputs, inits=()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _w(name: str, *shape: int) -> onnx.TensorProto:
    return numpy_helper.from_array(np.zeros(shape, np.float32), name)


def _vi(name: str, shape) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def test_matmul_batched_and_symbolic() -> None:
    m = _model(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        [_vi("x", ["batch", "seq", 64])],
        [_vi("y", None)],
        [_w("w", 64, 32)],
    )
    assert count_flops(m, {"batch": 3, "seq": 10}) == 2 * 3 * 10 * 64 * 32
    assert count_flops_by_node(m, {"batch": 1, "seq": 1}) == {"mm": 2 * 64 * 32}
    with pytest.raises(KilnError, match="seq"):
        count_flops(m, {"batch": 1})


def test_gemm_conv_grouped_3d_and_transpose() -> None:
    nodes = [
        helper.make_node("Gemm", ["a", "gw"], ["g"], transB=1),
        helper.make_node("Conv", ["x", "cw"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Conv", ["c", "dw"], ["d"], pads=[1, 1, 1, 1], group=16),
        helper.make_node("Conv", ["v", "vw"], ["v1"], pads=[1] * 6),
        helper.make_node("ConvTranspose", ["v1", "tw"], ["t"], strides=[2] * 3),
    ]
    inits = [
        _w("gw", 10, 20),
        _w("cw", 16, 3, 3, 3),
        _w("dw", 16, 1, 3, 3),
        _w("vw", 8, 4, 3, 3, 3),
        _w("tw", 8, 2, 2, 2, 2),
    ]
    m = _model(
        nodes,
        [_vi("a", ["n", 20]), _vi("x", ["n", 3, 32, 32]), _vi("v", ["n", 4, 8, 8, 8])],
        [_vi("g", None), _vi("d", None), _vi("t", None)],
        inits,
    )
    n = 2
    gemm = n * 10 * 20
    conv = n * 16 * 16 * 16 * 3 * 9  # output 16×16 after stride 2
    dw = n * 16 * 16 * 16 * 1 * 9
    conv3d = n * 8 * 8**3 * 4 * 27
    convt = n * 8 * 8**3 * 2 * 8  # per input element: C_out/group · prod(kernel)
    by_op = count_flops_by_op(m, {"n": n})
    assert by_op == {"Gemm": 2 * gemm, "Conv": 2 * (conv + dw + conv3d), "ConvTranspose": 2 * convt}
    assert count_flops(m, {"n": n}) == sum(by_op.values())


def test_does_not_mutate_and_uses_metadata_dims() -> None:
    model = zoo.build("bert-tiny")
    before = model.SerializeToString()
    assert count_flops(model, {"batch": 2, "seq": 16}) == 2 * count_flops(model, {})
    assert model.SerializeToString() == before


def test_tiny_models_count() -> None:
    for name in zoo.names():
        if zoo.entry(name).tiny:
            assert count_flops(zoo.build(name), zoo.entry(name).dims) > 0


@pytest.fixture(scope="module", params=[n for n in zoo.names() if not zoo.entry(n).tiny])
def full_model(request) -> tuple[str, onnx.ModelProto]:
    return request.param, zoo.build(request.param)


def test_full_models_match_published(full_model) -> None:
    name, model = full_model
    e = zoo.entry(name)
    assert e.published_gflops is not None
    gflops = count_flops(_without_weight_bytes(model), e.dims) / 1e9
    assert gflops == pytest.approx(e.published_gflops, rel=0.02), name


def _without_weight_bytes(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy whose big weights point at an external file that does not exist: counting must
    never read weight bytes (which keeps it fast on models of hundreds of megabytes)."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for t in copy.graph.initializer:
        if t.raw_data and len(t.raw_data) > 1 << 16:
            t.ClearField("raw_data")
            t.data_location = TensorProto.EXTERNAL
            t.external_data.add(key="location", value="absent.bin")
    return copy


def test_one_counter_with_node_costs() -> None:
    """count_flops_by_node is 2 × the MACs node_costs gives, node for node, fused ops included."""
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["m"], name="mm"),
        helper.make_node("Relu", ["m"], ["r"], name="relu"),
        helper.make_node(
            "FusedMatMul", ["r", "w2"], ["y"], name="fmm", domain="com.microsoft", transB=1
        ),
    ]
    m = _model(nodes, [_vi("x", [2, 8])], [_vi("y", None)], [_w("w", 8, 8), _w("w2", 4, 8)])
    m.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    costs = node_costs(m)
    by_node = count_flops_by_node(m)
    assert by_node == {"mm": 2 * 2 * 8 * 8, "fmm": 2 * 2 * 8 * 4}
    assert all(by_node[k] == 2 * costs[k].macs for k in by_node)
    assert count_flops_by_op(m) == {"MatMul": by_node["mm"], "FusedMatMul": by_node["fmm"]}


def test_matrix_product_of_unknown_shape_is_refused() -> None:
    """A FLOP count that silently dropped a matrix product would be wrong: it says which."""
    nodes = [
        helper.make_node("Frobnicate", ["x"], ["f"], name="custom", domain="custom"),
        helper.make_node("MatMul", ["f", "w"], ["y"], name="mm"),
    ]
    m = _model(nodes, [_vi("x", [2, 8])], [_vi("y", None)], [_w("w", 8, 8)])
    m.opset_import.append(helper.make_opsetid("custom", 1))
    with pytest.raises(KilnError, match="'mm'"):
        count_flops(m)
