"""Per-op cost formulas: multiply-accumulates, FLOPs, bytes moved and arithmetic precision of
one ONNX node, from the static shapes in a :class:`~kiln.cost.shapes.Tensors` table.

The conventions (what counts as a FLOP, which bytes are moved) are stated in
:mod:`kiln.cost.model`. Every function here raises :class:`~kiln.cost.shapes.UnknownShape`
when a shape it needs is unknown, and KilnError for an op without a formula.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import TensorProto, helper

from kiln.cost.shapes import Tensors, has_input
from kiln.errors import KilnError


def _ops(names: str) -> set[str]:
    return set(names.split())


def _table(rows: tuple[tuple[int, str], ...]) -> dict[str, int]:
    return {op: flops for flops, names in rows for op in names.split()}


# FLOPs per output element.
_PER_OUTPUT = _table(
    (
        (1, "Add Sub Mul Div Mod Max Min Sum Mean Equal Less LessOrEqual Greater"),
        (1, "GreaterOrEqual And Or Xor Not Where PRelu BitShift BitwiseAnd BitwiseOr"),
        (1, "BitwiseXor BitwiseNot Relu Neg Abs Sign Floor Ceil Round Reciprocal Sqrt"),
        (1, "Clip LeakyRelu ThresholdedRelu Shrink IsNaN IsInf Hardmax CumSum"),
        (1, "QuantizeLinear DequantizeLinear"),
        (2, "HardSigmoid Softsign BatchNormalization BiasAdd"),
        (3, "HardSwish LpNormalization QLinearAdd QLinearMul QLinearLeakyRelu"),
        (4, "Erf Tanh Exp Log Sigmoid Sin Cos Tan Asin Acos Atan Sinh Cosh Asinh Acosh"),
        (4, "Atanh Pow Softplus Elu Selu Celu"),
        (5, "Softmax LogSoftmax SimplifiedLayerNormalization"),
        (6, "QuickGelu QLinearSigmoid SkipSimplifiedLayerNormalization"),  # + 1 with a bias
        (8, "Gelu FastGelu Mish LayerNormalization InstanceNormalization GroupNormalization"),
        (8, "MeanVarianceNormalization"),
        (9, "BiasGelu SkipLayerNormalization"),  # LayerNorm + the skip add; + 1 with a bias
        (10, "EmbedLayerNormalization"),  # two embedding adds + LayerNorm
    )
)
# FLOPs per input element.
_PER_INPUT = _table(
    (
        (1, "ReduceMean ReduceSum ReduceMax ReduceMin ReduceProd ReduceL1 ArgMax ArgMin"),
        (1, "GlobalAveragePool GlobalMaxPool QLinearGlobalAveragePool"),
        (2, "ReduceL2 ReduceSumSquare GlobalLpPool"),
        (3, "DynamicQuantizeLinear ReduceLogSum"),
        (5, "ReduceLogSumExp"),
    )
)
_DATA_MOVEMENT = _ops(
    "Transpose Reshape Flatten Squeeze Unsqueeze Concat Split Slice Gather GatherElements "
    "GatherND Scatter ScatterND ScatterElements Expand Tile Pad Identity Cast CastLike Shape "
    "Size Constant ConstantOfShape Range DepthToSpace SpaceToDepth Dropout ReverseSequence "
    "Compress NonZero OneHot EyeLike Trilu QLinearConcat"
)
_READS_WHAT_IT_OUTPUTS = {"Gather", "GatherElements", "GatherND", "Slice"}  # data input
_POOLS = {"MaxPool", "AveragePool", "LpPool", "QLinearAveragePool"}
_INT8 = _ops(
    "MatMulInteger ConvInteger QLinearMatMul QLinearConv QGemm DynamicQuantizeMatMul "
    "MatMulIntegerToFloat QAttention QLinearAdd QLinearMul QLinearSigmoid QLinearLeakyRelu "
    "QLinearGlobalAveragePool QLinearAveragePool"
)
# Where a matrix product's operands sit, as a plain ONNX node of the same arithmetic:
# (proxy op, input indices of A/X and B/W, bias input index or None).
_PROXIES = {
    "MatMul": ("MatMul", (0, 1), None),
    "MatMulInteger": ("MatMul", (0, 1), None),
    "QLinearMatMul": ("MatMul", (0, 3), None),
    "DynamicQuantizeMatMul": ("MatMul", (0, 1), 4),
    "MatMulIntegerToFloat": ("MatMul", (0, 1), 6),
    "Gemm": ("Gemm", (0, 1), 2),
    "QGemm": ("Gemm", (0, 3), 6),
    "Conv": ("Conv", (0, 1), 2),
    "ConvInteger": ("Conv", (0, 1), None),
    "QLinearConv": ("Conv", (0, 3), 8),
    "FusedConv": ("Conv", (0, 1), 2),
    "ConvTranspose": ("ConvTranspose", (0, 1), 2),
}
_ATTENTION = {"Attention", "QAttention", "MultiHeadAttention"}
_SCORE_FLOPS = 7  # per attention score: scale, mask add, softmax (~5)

# Every op whose cost includes matrix products (multiply-accumulates).
MATRIX_OPS = frozenset({*_PROXIES, *_ATTENTION, "FusedMatMul", "MatMulNBits", "Einsum"})


def node_flops(node: onnx.NodeProto, t: Tensors) -> tuple[int, int]:
    """(MACs, FLOPs) of one node; UnknownShape when a needed shape is unknown, KilnError when
    the op has no formula (KeyError/IndexError/ValueError for a malformed node)."""
    op, attrs = node.op_type, {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if op in _DATA_MOVEMENT:
        return 0, 0
    if op in _PROXIES:
        return _proxied(node, t)
    if op == "FusedMatMul":
        a, b = t.need(node.input[0]), t.need(node.input[1])
        m, k = (a[-1], a[-2]) if attrs.get("transA", 0) else (a[-2], a[-1])
        n = b[-2] if attrs.get("transB", 0) else b[-1]
        macs = t.numel(node.output[0]) // (m * n) * m * k * n  # batch · M · K · N
        return macs, 2 * macs + t.numel(node.output[0])  # + alpha scaling
    if op == "MatMulNBits":  # A [..., K] × dequantized 4-bit B [K, N]
        k, n = attrs["K"], attrs["N"]
        macs = t.numel(node.input[0]) // k * k * n
        return macs, 2 * macs + 2 * k * n
    if op in _ATTENTION:
        return _attention(node, attrs, t)
    if op == "Einsum":
        return _einsum(node, attrs, t)
    return 0, _elementwise_flops(node, attrs, t)


def node_bytes(node: onnx.NodeProto, t: Tensors) -> int:
    """Bytes read and written by one node, counting only the tensors whose size is known."""
    if node.op_type == "Constant":  # engines hold it as a weight; its readers count it
        return 0
    total = 0
    for i, name in enumerate(node.input):
        if not name or (i == 0 and node.op_type in ("Shape", "Size")):
            continue
        size = t.nbytes(name)
        if i == 0 and node.op_type in _READS_WHAT_IT_OUTPUTS:
            out = t.numel_or_none(node.output[0])
            dtype_size = t.itemsize(name)
            if out is not None and dtype_size is not None:
                size = min(size or 0, int(out * dtype_size))
        total += size or 0
    return total + sum(t.nbytes(name) or 0 for name in node.output if name)


def node_precision(node: onnx.NodeProto, t: Tensors) -> str:
    """ "int8" for quantized kernels (and QDQ pairs an engine fuses into one), else the float
    type of its first input ("fp16", "bf16", or "fp32" for everything else)."""
    if node.op_type in _INT8:
        return "int8"
    # QDQ form: ONNX Runtime runs DequantizeLinear → Conv/MatMul/Gemm on 8-bit operands as one
    # integer kernel (QLinearConv, ...).
    eight_bit = (TensorProto.INT8, TensorProto.UINT8)
    operands = [t.dequantized.get(name) for name in node.input[:2]]
    if node.op_type in ("Conv", "MatMul", "Gemm") and all(e in eight_bit for e in operands):
        return "int8"
    elem = t.elem(node.input[0]) if node.input else None
    return {TensorProto.FLOAT16: "fp16", TensorProto.BFLOAT16: "bf16"}.get(elem, "fp32")


# ---------------------------------------------------------------------------- matrix products
def _proxied(node: onnx.NodeProto, t: Tensors) -> tuple[int, int]:
    """A matrix product costed as the plain MatMul/Gemm/Conv/ConvTranspose of its operands,
    plus its bias and whatever the fused or quantized form adds."""
    proxy, (a, b), bias = _PROXIES[node.op_type]
    keep = {"transA", "transB"} if proxy == "Gemm" else set()
    sub = helper.make_node(proxy, [node.input[a], node.input[b]], [node.output[0]])
    sub.attribute.extend(x for x in node.attribute if x.name in keep)
    macs = _macs(sub, t)
    extra = t.numel(node.output[0]) if has_input(node, bias) else 0
    if node.op_type == "FusedConv":  # its activation, and the sum input Z when present
        extra += t.numel(node.output[0]) * (1 + has_input(node, 3))
    if node.op_type == "DynamicQuantizeMatMul":  # quantizing A on the fly
        extra += 3 * t.numel(node.input[0])
    return macs, 2 * macs + extra


def _macs(node: onnx.NodeProto, t: Tensors) -> int:
    """Multiply-accumulates of a default-domain MatMul, Gemm, Conv or ConvTranspose."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "MatMul":
        a, b = t.need(node.input[0]), t.need(node.input[1])
        a = [1, *a] if len(a) == 1 else a
        b = [*b, 1] if len(b) == 1 else b
        batch = np.broadcast_shapes(tuple(a[:-2]), tuple(b[:-2]))
        return math.prod(batch) * a[-2] * a[-1] * b[-1]
    if node.op_type == "Gemm":
        a, b = t.need(node.input[0]), t.need(node.input[1])
        m, k = (a[1], a[0]) if attrs.get("transA", 0) else (a[0], a[1])
        n = b[0] if attrs.get("transB", 0) else b[1]
        return m * k * n
    if node.op_type == "Conv":  # each output element: (C_in / group) · prod(kernel) MACs
        return t.numel(node.output[0]) * math.prod(t.need(node.input[1])[1:])
    # ConvTranspose: each input element scatters to (C_out / group) · prod(kernel) outputs
    return t.numel(node.input[0]) * math.prod(t.need(node.input[1])[1:])


def _attention(node: onnx.NodeProto, attrs: dict, t: Tensors) -> tuple[int, int]:
    """ORT Attention/QAttention (input × packed QKV weights, then attention) and
    MultiHeadAttention (projected Q, K, V in; packed, 3-D or 4-D BNSH forms)."""
    heads = attrs["num_heads"]
    q = t.need(node.input[0])
    batch, seq = q[0], q[1]
    projection = bias = 0
    if node.op_type in ("Attention", "QAttention"):
        w = t.need(node.input[1])
        sizes = attrs.get("qkv_hidden_sizes") or [w[1] // 3] * 3
        d, dv = sizes[0], sizes[2]
        past = 4 if node.op_type == "Attention" else 8
        total = seq + (t.need(node.input[past])[3] if has_input(node, past) else 0)
        projection = batch * seq * w[0] * w[1]
        bias = batch * seq * w[1] if has_input(node, 2) else 0
        if node.op_type == "QAttention":
            bias += 3 * batch * seq * w[0]  # quantizing the input on the fly
    else:
        d = q[2] if len(q) == 3 else q[2] * q[4]  # [B,S,D] or packed [B,S,N,3,H]
        total, dv = seq, d
        if has_input(node, 1):
            k = t.need(node.input[1])  # [B,L,D], [B,N,L,H] or packed KV [B,L,N,2,H]
            total = k[2] if len(k) == 4 else k[1]
            dv = k[2] * k[4] if len(k) == 5 else dv
        if has_input(node, 2):
            v = t.need(node.input[2])
            dv = v[2] if len(v) == 3 else v[1] * v[3]
        if has_input(node, 6):  # past_key [B,N,P,H]
            total += t.need(node.input[6])[2]
        if has_input(node, 3):
            bias = batch * (seq * d + total * (d + dv))
    macs = projection + batch * seq * total * (d + dv)  # QKᵀ and attention·V over all heads
    return macs, 2 * macs + bias + _SCORE_FLOPS * batch * heads * seq * total


def _einsum(node: onnx.NodeProto, attrs: dict, t: Tensors) -> tuple[int, int]:
    equation = attrs["equation"]
    equation = (equation.decode() if isinstance(equation, bytes) else equation).replace(" ", "")
    terms = equation.split("->")[0].split(",")
    if len(terms) != 2 or "." in equation:  # reductions and ellipses: 1 per input element
        return 0, t.numel(node.input[0])
    size: dict[str, int] = {}
    for term, name in zip(terms, node.input, strict=True):
        size.update(zip(term, t.need(name), strict=True))
    macs = math.prod(size.values())  # every index combination is one multiply-accumulate
    return macs, 2 * macs


# ---------------------------------------------------------------------------- elementwise
def _elementwise_flops(node: onnx.NodeProto, attrs: dict, t: Tensors) -> int:
    """FLOPs of an op without matrix products: per output or input element, pools, Resize."""
    op = node.op_type
    if op in _PER_OUTPUT:
        per = _PER_OUTPUT[op]
        if op in ("Sum", "Max", "Min", "Mean"):  # variadic: n - 1 operations per output
            per = max(1, len(node.input) - 1)
        if op in ("SkipLayerNormalization", "SkipSimplifiedLayerNormalization"):
            per += has_input(node, 4)  # the bias input
        return per * t.numel(node.output[0])
    if op in _PER_INPUT:
        return _PER_INPUT[op] * t.numel(node.input[0])
    if op in _POOLS:
        return t.numel(node.output[0]) * math.prod(attrs["kernel_shape"])
    if op in ("Resize", "Upsample"):
        mode = attrs.get("mode", b"nearest")
        mode = mode.decode() if isinstance(mode, bytes) else mode
        axes = sum(
            i != o for i, o in zip(t.need(node.input[0]), t.need(node.output[0]), strict=True)
        )
        taps = {"nearest": 0, "linear": 3 * (2**axes - 1), "cubic": 2 * 4**axes}.get(mode, 0)
        return taps * t.numel(node.output[0])
    raise KilnError(f"no cost formula for {node.domain or 'ai.onnx'}::{op}")
