"""kiln.cost: per-node FLOPs and bytes checked by hand on tiny graphs, against published
figures on the zoo, on every node of compiled artifacts, and the roofline arithmetic."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln import zoo
from kiln.cost import (
    NodeCost,
    count_flops,
    count_flops_by_node,
    node_costs,
    roofline,
    total_cost,
    unknown_ops,
)
from kiln.errors import KilnError
from kiln.hardware import Peaks

F = TensorProto.FLOAT


def _model(nodes, inputs, outputs, inits=(), ms: bool = False) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    opsets = [helper.make_opsetid("", 17)]
    if ms:
        opsets += [helper.make_opsetid("com.microsoft", 1), helper.make_opsetid("custom", 1)]
    return helper.make_model(graph, opset_imports=opsets)


def _w(name: str, *shape: int, dtype=np.float32) -> onnx.TensorProto:
    return numpy_helper.from_array(np.zeros(shape, dtype), name)


def _vi(name: str, shape, elem: int = F) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, shape)


def test_matmul_flops_and_bytes() -> None:
    m = _model(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        [_vi("x", ["n", 3])],
        [_vi("y", None)],
        [_w("w", 3, 4)],
    )
    cost = node_costs(m, {"n": 2})["mm"]
    assert cost == NodeCost("MatMul", flops=2 * 2 * 3 * 4, bytes=(6 + 12 + 8) * 4, macs=24)
    assert cost.intensity == pytest.approx(48 / 104)


def test_grouped_depthwise_3d_and_transposed_convolutions() -> None:
    nodes = [
        helper.make_node("Conv", ["x", "gw", "gb"], ["g"], name="grouped", group=4, pads=[1] * 4),
        helper.make_node("Conv", ["g", "dw"], ["d"], name="depthwise", group=16, pads=[1] * 4),
        helper.make_node("Conv", ["v", "vw"], ["v1"], name="conv3d", pads=[1] * 6),
        helper.make_node("ConvTranspose", ["v1", "tw", "tb"], ["t"], name="up", strides=[2] * 3),
    ]
    inits = [
        _w("gw", 16, 2, 3, 3),
        _w("gb", 16),
        _w("dw", 16, 1, 3, 3),
        _w("vw", 3, 2, 3, 3, 3),
        _w("tw", 3, 2, 2, 2, 2),
        _w("tb", 2),
    ]
    m = _model(
        nodes,
        [_vi("x", [1, 8, 10, 10]), _vi("v", [1, 2, 4, 4, 4])],
        [_vi("d", None), _vi("t", None)],
        inits,
    )
    c = node_costs(m)
    # grouped: each of 1600 outputs takes (8 / 4) · 3 · 3 MACs, plus its bias
    assert (c["grouped"].macs, c["grouped"].flops) == (1600 * 18, 2 * 1600 * 18 + 1600)
    assert c["grouped"].bytes == (800 + 16 * 2 * 9 + 16 + 1600) * 4
    assert (c["depthwise"].macs, c["depthwise"].flops) == (1600 * 9, 2 * 1600 * 9)
    assert c["conv3d"].macs == 3 * 4**3 * 2 * 27
    # transposed: each of 192 inputs scatters to (C_out / group) · 2³ outputs, + bias
    assert (c["up"].macs, c["up"].flops) == (192 * 2 * 8, 2 * 192 * 16 + 2 * 8**3)
    assert sum(2 * x.macs for x in c.values()) == count_flops(m)


def test_attention_counts_projection_scores_and_context() -> None:
    b, s, h, heads = 2, 5, 8, 2
    nodes = [
        helper.make_node(
            "Attention",
            ["x", "w", "bias", "mask"],
            ["ctx"],
            name="attn",
            domain="com.microsoft",
            num_heads=heads,
        ),
        helper.make_node("Add", ["ctx", "x"], ["y"], name="residual"),
    ]
    m = _model(
        nodes,
        [_vi("x", ["batch", "seq", h]), _vi("mask", ["batch", "seq"], TensorProto.INT32)],
        [_vi("y", None)],
        [_w("w", h, 3 * h), _w("bias", 3 * h)],
        ms=True,
    )
    c = node_costs(m, {"batch": b, "seq": s})
    macs = b * s * h * 3 * h + b * s * s * h * 2  # QKV projection, QKᵀ, attention·V
    assert c["attn"].macs == macs
    assert c["attn"].flops == 2 * macs + b * s * 3 * h + 7 * b * heads * s * s
    assert c["attn"].bytes == (80 + 8 * 24 + 24 + 80) * 4 + 10 * 4
    assert c["residual"] == NodeCost("Add", flops=80, bytes=3 * 80 * 4)  # shape propagated


def test_multi_head_attention_with_longer_keys() -> None:
    node = helper.make_node(
        "MultiHeadAttention",
        ["q", "k", "v"],
        ["o"],
        name="mha",
        domain="com.microsoft",
        num_heads=2,
    )
    m = _model(
        [node, helper.make_node("Relu", ["o"], ["r"], name="relu")],
        [_vi("q", [1, 4, 8]), _vi("k", [1, 6, 8]), _vi("v", [1, 6, 12])],
        [_vi("r", None)],
        ms=True,
    )
    c = node_costs(m)
    assert c["mha"].macs == 4 * 6 * (8 + 12)
    assert c["mha"].flops == 2 * 4 * 6 * 20 + 7 * 2 * 4 * 6
    assert c["relu"].flops == 4 * 12  # output [1, 4, 12] inferred by Kiln's rule


def test_fused_ops_of_compiled_graphs() -> None:
    nodes = [
        helper.make_node(
            "FusedConv", ["x", "w", "b"], ["c"], name="fc", domain="com.microsoft", pads=[1] * 4
        ),
        helper.make_node("Flatten", ["c"], ["f"], name="flat"),
        helper.make_node(
            "SkipLayerNormalization",
            ["f", "f", "gamma", "beta"],
            ["ln", "", "", "sum"],
            name="sln",
            domain="com.microsoft",
        ),
        helper.make_node("BiasGelu", ["ln", "beta"], ["gelu"], name="bg", domain="com.microsoft"),
        helper.make_node(
            "FusedMatMul", ["gelu", "w2"], ["mm"], name="fmm", domain="com.microsoft", transB=1
        ),
    ]
    m = _model(
        nodes,
        [_vi("x", [1, 2, 4, 4])],
        [_vi("mm", None), _vi("sum", None)],
        [_w("w", 4, 2, 3, 3), _w("b", 4), _w("gamma", 64), _w("beta", 64), _w("w2", 10, 64)],
        ms=True,
    )
    c = node_costs(m)
    assert all(x.known for x in c.values()), c
    assert c["fc"].macs == 64 * 18 and c["fc"].flops == 2 * 64 * 18 + 2 * 64  # bias, activation
    assert c["sln"].flops == 9 * 64 and c["sln"].bytes == (64 * 4 + 64 * 2) * 4
    assert c["bg"].flops == 9 * 64
    assert c["fmm"].macs == 64 * 10 and c["fmm"].flops == 2 * 640 + 10


def test_shape_arithmetic_after_a_contrib_op_is_resolved() -> None:
    """FusedConv's output shape (Kiln's rule) feeds Shape → Slice → Concat → Reshape, which
    ONNX inference can then fold, so the MatMul behind it is counted."""
    nodes = [
        helper.make_node(
            "FusedConv", ["x", "w"], ["c"], name="fc", domain="com.microsoft", pads=[1] * 4
        ),
        helper.make_node("Shape", ["c"], ["s"], name="shape"),
        helper.make_node("Slice", ["s", "zero", "two"], ["s2"], name="slice"),
        helper.make_node("Concat", ["s2", "minus1"], ["target"], name="concat", axis=0),
        helper.make_node("Reshape", ["c", "target"], ["r"], name="reshape"),
        helper.make_node("MatMul", ["r", "w2"], ["y"], name="mm"),
    ]
    consts = [
        numpy_helper.from_array(np.array(v, np.int64), n)
        for n, v in (("zero", [0]), ("two", [2]), ("minus1", [-1]))
    ]
    m = _model(
        nodes,
        [_vi("x", [1, 2, 4, 4])],
        [_vi("y", None)],
        [_w("w", 4, 2, 3, 3), _w("w2", 16, 8), *consts],
        ms=True,
    )
    c = node_costs(m)
    assert unknown_ops(c) == []
    assert c["mm"].macs == 4 * 16 * 8 and c["reshape"].bytes == (64 * 4 + 3 * 8) + 64 * 4


def test_quantized_ops_count_int8_bytes_and_precision() -> None:
    u8 = TensorProto.UINT8
    nodes = [
        helper.make_node("MatMulInteger", ["a", "w"], ["y"], name="mmi"),
        helper.make_node(
            "DynamicQuantizeMatMul",
            ["x", "w", "s", "z"],
            ["dq"],
            name="dqmm",
            domain="com.microsoft",
        ),
        helper.make_node("QuantizeLinear", ["dq", "s1", "z1"], ["q"], name="quant"),
        helper.make_node("DequantizeLinear", ["q", "s1", "z1"], ["deq"], name="dequant"),
    ]
    inits = [
        _w("w", 16, 8, dtype=np.int8),
        _w("s", 1),
        _w("z", 1, dtype=np.int8),
        _w("s1", dtype=np.float32),
        _w("z1", dtype=np.uint8),
    ]
    m = _model(
        nodes,
        [_vi("a", [4, 16], u8), _vi("x", [4, 16])],
        [_vi("y", None, TensorProto.INT32), _vi("deq", None)],
        inits,
        ms=True,
    )
    c = node_costs(m)
    assert c["mmi"] == NodeCost("MatMulInteger", 1024, 64 + 128 + 32 * 4, 512, "int8")
    assert c["dqmm"].flops == 1024 + 3 * 64 and c["dqmm"].precision == "int8"
    assert c["quant"].flops == 32 and c["quant"].bytes == 32 * 4 + 4 + 1 + 32
    assert c["dequant"].flops == 32 and c["dequant"].precision == "fp32"


def test_matmul_nbits_counts_the_product_and_the_dequantization() -> None:
    node = helper.make_node(
        "MatMulNBits",
        ["a", "b", "scales"],
        ["y"],
        name="nbits",
        domain="com.microsoft",
        K=32,
        N=8,
        bits=4,
        block_size=32,
    )
    m = _model(
        [node, helper.make_node("Relu", ["y"], ["r"], name="relu")],
        [_vi("a", [4, 32])],
        [_vi("r", None)],
        [_w("b", 8, 1, 16, dtype=np.uint8), _w("scales", 8)],
        ms=True,
    )
    c = node_costs(m)
    assert c["nbits"].macs == 4 * 32 * 8 and c["nbits"].flops == 2 * 4 * 32 * 8 + 2 * 32 * 8
    assert c["nbits"].bytes == 4 * 32 * 4 + 8 * 16 + 8 * 4 + 4 * 8 * 4
    assert c["relu"].flops == 32  # output [4, 8] from Kiln's rule


@pytest.mark.parametrize(
    ("node", "flops"),
    [
        (helper.make_node("Relu", ["x"], ["y"]), 24),
        (helper.make_node("Erf", ["x"], ["y"]), 4 * 24),
        (helper.make_node("Softmax", ["x"], ["y"]), 5 * 24),
        (helper.make_node("LayerNormalization", ["x", "g3"], ["y"], axis=-1), 8 * 24),
        (helper.make_node("Sum", ["x", "x", "x"], ["y"]), 2 * 24),
        (helper.make_node("ReduceMean", ["x"], ["y"], axes=[2]), 24),
        (helper.make_node("Transpose", ["x"], ["y"], perm=[2, 0, 1]), 0),
        (helper.make_node("MaxPool", ["x"], ["y"], kernel_shape=[2], strides=[2]), 12 * 2),
        (helper.make_node("GlobalAveragePool", ["x"], ["y"]), 24),
    ],
)
def test_elementwise_normalisation_reduction_pooling_and_data_movement(node, flops) -> None:
    node.name = "n"
    m = _model([node], [_vi("x", [2, 3, 4])], [_vi("y", None)], [_w("g3", 4)])
    cost = node_costs(m)["n"]
    assert cost.known and cost.flops == flops
    out = onnx.shape_inference.infer_shapes(m).graph.output[0].type.tensor_type.shape.dim
    out_elements = int(np.prod([d.dim_value for d in out]))
    weights = 16 if "g3" in node.input else 0
    assert cost.bytes == 24 * 4 * (len(node.input) - bool(weights)) + weights + out_elements * 4


def test_resize_gather_and_unknown_ops() -> None:
    nodes = [
        helper.make_node("Resize", ["img", "", "scales"], ["big"], name="resize", mode="linear"),
        helper.make_node("Gather", ["table", "ids"], ["rows"], name="embed"),
        helper.make_node("Frobnicate", ["rows"], ["out"], name="custom", domain="custom"),
    ]
    m = _model(
        nodes,
        [_vi("img", [1, 1, 2, 2]), _vi("ids", [1, 5], TensorProto.INT64)],
        [_vi("big", None), _vi("out", None)],
        [
            _w("table", 1000, 64),
            numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"),
        ],
        ms=True,
    )
    c = node_costs(m)
    assert c["resize"].flops == 16 * 3 * (2**2 - 1)  # bilinear: three lerps per output
    # a gather reads only the rows it returns, not the whole table
    assert c["embed"].bytes == 5 * 64 * 4 + 5 * 8 + 5 * 64 * 4 and c["embed"].flops == 0
    assert c["custom"] == NodeCost("Frobnicate", 0, 5 * 64 * 4, known=False)
    assert unknown_ops(c) == ["Frobnicate"]
    assert not total_cost(c.values()).known


def test_unnamed_nodes_share_count_flops_keys() -> None:
    model = zoo.build("resnet-tiny")
    for node in model.graph.node:
        node.name = ""
    costs = node_costs(model)
    by_node = count_flops_by_node(model)
    assert set(by_node) <= set(costs) and len(costs) == len(model.graph.node)
    assert all(2 * costs[key].macs == flops for key, flops in by_node.items())


@pytest.mark.parametrize("name", zoo.names())
def test_every_zoo_node_is_costed_and_macs_agree_with_flops(name) -> None:
    e = zoo.entry(name)
    model = zoo.build(name)
    costs = node_costs(model, e.dims)
    assert len(costs) == len(model.graph.node)
    assert unknown_ops(costs) == []
    assert all(c.bytes > 0 for c in costs.values()), [k for k, c in costs.items() if not c.bytes]
    total = total_cost(costs.values())
    assert 2 * total.macs == count_flops(model, e.dims)
    if e.published_gflops:  # published figures are 2 × MACs; ours add the elementwise work
        assert 2 * total.macs / 1e9 == pytest.approx(e.published_gflops, rel=0.02)
        # MobileNetV2 does so little per activation that its unfolded BatchNorm and ReLU6
        # add 3.5 %; everywhere else they add under 1 %.
        share = 0.05 if name == "mobilenetv2" else 0.03
        assert total.flops / 1e9 == pytest.approx(e.published_gflops, rel=share)
        assert total.flops >= 2 * total.macs


@pytest.mark.parametrize(
    ("name", "precision"),
    [
        ("bert-tiny", "fp32"),
        ("gpt2-tiny", "fp32"),
        ("mobilenetv2-tiny", "fp32"),
        ("bert-tiny", "int8"),
        ("resnet-tiny", "int8"),
    ],
)
def test_every_node_of_a_compiled_artifact_is_costed(name, precision, tmp_path) -> None:
    kiln.compile(f"zoo:{name}", tmp_path / "m.kiln", precision=precision, rounds=0)
    model = onnx.load(tmp_path / "m.kiln" / "model.onnx")
    costs = node_costs(model)
    assert unknown_ops(costs) == []
    assert all(c.bytes > 0 for c in costs.values()), [k for k, c in costs.items() if not c.bytes]
    fused = {c.op_type for c in costs.values()} - {n.op_type for n in zoo.build(name).graph.node}
    assert fused  # the artifact holds fused or quantized ops, and they are costed
    original = count_flops(zoo.build(name), zoo.entry(name).dims)
    compiled = 2 * total_cost(costs.values()).macs
    assert compiled == pytest.approx(original, rel=0.05)  # fusion keeps the arithmetic
    if precision == "int8":
        assert any(c.precision == "int8" and c.macs for c in costs.values())


def test_graph_fused_by_ort_transformers_optimizer_is_costed() -> None:
    """EmbedLayerNormalization, Attention, SkipLayerNorm, BiasGelu, and no com.microsoft
    opset import (ONNX Runtime's optimizer leaves it out)."""
    import onnx_ir as ir

    from kiln.backends.ort_transformers import transformers_optimize

    original = zoo.build("bert-tiny")
    fused = transformers_optimize(ir.from_proto(original), "bert")
    assert "EmbedLayerNormalization" in {n.op_type for n in fused.graph.node}
    costs = node_costs(fused, zoo.entry("bert-tiny").dims)
    assert unknown_ops(costs) == [] and all(c.bytes for c in costs.values())
    assert 2 * total_cost(costs.values()).macs == count_flops(original)


PEAKS = Peaks(
    fp32_gflops=100.0,
    bf16_gflops=None,
    int8_gops=400.0,
    bandwidth_gbs=10.0,
    threads=2,
    measured_at="x",
)


def test_roofline_compute_and_memory_bound() -> None:
    gemm = NodeCost("MatMul", flops=2_000_000_000, bytes=10_000_000, macs=10**9)  # 200 FLOP/B
    r = roofline(gemm, 0.04, PEAKS)
    assert r["bound"] == "compute" and r["attainable_gflops"] == 100.0
    assert r["achieved_gflops"] == pytest.approx(50.0) and r["fraction"] == pytest.approx(0.5)
    assert r["ridge"] == 10.0
    add = NodeCost("Add", flops=1_000_000, bytes=12_000_000)  # 1/12 FLOP per byte
    r = roofline(add, 0.0024, PEAKS)
    assert r["bound"] == "memory"
    assert r["attainable_gflops"] == pytest.approx(10.0 / 12)
    assert r["roofline_seconds"] == pytest.approx(0.0012) and r["fraction"] == pytest.approx(0.5)
    copy = NodeCost("Transpose", flops=0, bytes=1_000_000)
    assert roofline(copy, 0.001, PEAKS)["fraction"] == pytest.approx(0.1)


def test_roofline_precisions() -> None:
    int8 = NodeCost("MatMulInteger", flops=8 * 10**9, bytes=10**6, macs=4 * 10**9, precision="int8")
    assert roofline(int8, 1.0, PEAKS)["peak_gflops"] == 400.0  # the node's own precision
    assert roofline(int8, 1.0, PEAKS, precision="fp32")["peak_gflops"] == 100.0
    bf16 = roofline(int8, 1.0, PEAKS, precision="bf16")  # no bf16 kernels: the fp32 roof
    assert (bf16["peak_gflops"], bf16["precision"]) == (100.0, "fp32")
    with pytest.raises(KilnError, match="precision"):
        roofline(int8, 1.0, PEAKS, precision="fp8")
    with pytest.raises(KilnError, match="positive"):
        roofline(int8, 0.0, PEAKS)
