"""Cost of every node of an ONNX model: FLOPs and bytes moved, from shapes alone.

What is counted, per node of the main graph (control-flow bodies are not entered):

* **FLOPs.** Matrix products at 2 per multiply-accumulate (``macs``), exactly as
  :mod:`kiln.cost.flops` counts them for MatMul/Gemm/Conv/ConvTranspose, and likewise for their
  integer and fused forms (MatMulInteger, QLinearMatMul, QLinearConv, ConvInteger, QGemm,
  DynamicQuantizeMatMul, MatMulIntegerToFloat, MatMulNBits, FusedConv, FusedMatMul, Einsum).
  ORT's Attention/QAttention count the QKV projection, QKᵀ and attention·V; MultiHeadAttention
  QKᵀ and attention·V. On top: bias adds (1 per output), elementwise ops (1 per output element;
  Erf/Tanh/Exp/Sigmoid/Log and friends 4; GELU forms ~8), Softmax ~5 per element (plus scale
  and mask inside attention), LayerNorm ~8, BatchNorm 2, reductions and global pooling 1 per
  *input* element, pooling prod(kernel) per output, Resize 0 (nearest) or ~3 per lerp,
  Quantize/DequantizeLinear 1 per element. Data movement (Transpose, Reshape, Concat, Gather,
  Slice, Expand, Cast, ...) is 0 FLOPs.
* **Bytes.** Every input (weights included) and every output at its dtype's size; a gather or
  slice reads only the elements it outputs, Shape/Size read no data, a Constant moves nothing
  (its readers count it). Views (Reshape, Squeeze) are counted like copies, which engines
  often avoid.

The published model figures are 2 × MACs; the extra elementwise FLOPs add well under 3 % on
ResNet-50, BERT-base and ViT-B/16. Symbolic dims are fixed as in :mod:`kiln.cost.flops`
(``dims``, else the model's ``kiln.dims`` metadata); ONNX shape inference supplies shapes, then
the model's own value_info (compiled artifacts carry it) and Kiln's rules for the com.microsoft
ops ONNX does not know (a shape they give is fed back to ONNX inference, which can then
resolve shape arithmetic downstream). An op type without a formula (or whose shapes stay
unknown) gets 0 FLOPs, the bytes that are known, and ``known=False``; :func:`unknown_ops`
lists them.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from kiln.cost.flops import _infer, _macs, _resolve_dims
from kiln.errors import KilnError

Shape = list[int]


@dataclass(frozen=True)
class NodeCost:
    """FLOPs (2 per multiply-accumulate) and bytes moved by one node (or a sum of nodes)."""

    op_type: str
    flops: int
    bytes: int
    macs: int = 0  # multiply-accumulates of matrix products: what kiln.cost.flops counts
    precision: str = "fp32"  # of its arithmetic: "int8" for quantized kernels, else the dtype
    known: bool = True  # False: no formula for the op, or the shapes it needs are unknown

    @property
    def intensity(self) -> float:
        """Arithmetic intensity, FLOPs per byte moved (0 for pure data movement)."""
        return self.flops / self.bytes if self.bytes else 0.0


def node_costs(
    model: onnx.ModelProto, dims: Mapping[str, int] | None = None
) -> dict[str, NodeCost]:
    """Cost of every node of the main graph, keyed by node name (``#index:OpType`` when
    unnamed, as :func:`kiln.cost.flops.count_flops_by_node`), in graph order."""
    tensors = _known_tensors(model, _resolve_dims(model, dims))
    return {
        node.name or f"#{i}:{node.op_type}": _node_cost(node, tensors)
        for i, node in enumerate(model.graph.node)
    }


def total_cost(costs: Iterable[NodeCost], op_type: str = "model") -> NodeCost:
    """The sum of many nodes' costs (known only if every part is)."""
    costs = list(costs)
    return NodeCost(
        op_type=op_type,
        flops=sum(c.flops for c in costs),
        bytes=sum(c.bytes for c in costs),
        macs=sum(c.macs for c in costs),
        precision=_common({c.precision for c in costs if c.flops}) or "fp32",
        known=all(c.known for c in costs),
    )


def unknown_ops(costs: Mapping[str, NodeCost]) -> list[str]:
    """Op types whose FLOPs could not be counted (sorted, each once)."""
    return sorted({c.op_type for c in costs.values() if not c.known})


# ---------------------------------------------------------------------------- formulas
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


class _UnknownShape(Exception):
    pass


def _node_cost(node: onnx.NodeProto, t: _Tensors) -> NodeCost:
    try:
        macs, flops = _flops(node, t)
        known = True
    except (_UnknownShape, KilnError, KeyError, IndexError, ValueError, ZeroDivisionError):
        # no formula, an unknown shape, or a node malformed (a missing attribute or input):
        # the cost is advisory, so the node is marked rather than the whole model refused
        macs, flops, known = 0, 0, False
    return NodeCost(node.op_type, flops, _bytes(node, t), macs, _precision(node, t), known)


def _flops(node: onnx.NodeProto, t: _Tensors) -> tuple[int, int]:
    """(MACs, FLOPs) of one node; raises _UnknownShape when a needed shape is unknown."""
    op, attrs = node.op_type, {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if op in _DATA_MOVEMENT:
        return 0, 0
    if op in _PROXIES:
        proxy, (a, b), bias = _PROXIES[op]
        keep = {"transA", "transB"} if proxy == "Gemm" else set()
        sub = helper.make_node(proxy, [node.input[a], node.input[b]], [node.output[0]])
        sub.attribute.extend(x for x in node.attribute if x.name in keep)
        macs = _macs(sub, t.shapes, _NAMELESS)
        extra = t.numel(node.output[0]) if _has(node, bias) else 0
        if op == "FusedConv":  # its activation, and the sum input Z when present
            extra += t.numel(node.output[0]) * (1 + _has(node, 3))
        if op == "DynamicQuantizeMatMul":  # quantizing A on the fly
            extra += 3 * t.numel(node.input[0])
        return macs, 2 * macs + extra
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
    if op in _PER_OUTPUT:
        per = _PER_OUTPUT[op]
        if op in ("Sum", "Max", "Min", "Mean"):  # variadic: n - 1 operations per output
            per = max(1, len(node.input) - 1)
        if op in ("SkipLayerNormalization", "SkipSimplifiedLayerNormalization"):
            per += _has(node, 4)  # the bias input
        return 0, per * t.numel(node.output[0])
    if op in _PER_INPUT:
        return 0, _PER_INPUT[op] * t.numel(node.input[0])
    if op in _POOLS:
        return 0, t.numel(node.output[0]) * math.prod(attrs["kernel_shape"])
    if op in ("Resize", "Upsample"):
        mode = attrs.get("mode", b"nearest")
        mode = mode.decode() if isinstance(mode, bytes) else mode
        axes = sum(
            i != o for i, o in zip(t.need(node.input[0]), t.need(node.output[0]), strict=True)
        )
        taps = {"nearest": 0, "linear": 3 * (2**axes - 1), "cubic": 2 * 4**axes}.get(mode, 0)
        return 0, taps * t.numel(node.output[0])
    raise KilnError(f"no cost formula for {node.domain or 'ai.onnx'}::{op}")


def _attention(node: onnx.NodeProto, attrs: dict, t: _Tensors) -> tuple[int, int]:
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
        total = seq + (t.need(node.input[past])[3] if _has(node, past) else 0)
        projection = batch * seq * w[0] * w[1]
        bias = batch * seq * w[1] if _has(node, 2) else 0
        if node.op_type == "QAttention":
            bias += 3 * batch * seq * w[0]  # quantizing the input on the fly
    else:
        d = q[2] if len(q) == 3 else q[2] * q[4]  # [B,S,D] or packed [B,S,N,3,H]
        total, dv = seq, d
        if _has(node, 1):
            k = t.need(node.input[1])  # [B,L,D], [B,N,L,H] or packed KV [B,L,N,2,H]
            total = k[2] if len(k) == 4 else k[1]
            dv = k[2] * k[4] if len(k) == 5 else dv
        if _has(node, 2):
            v = t.need(node.input[2])
            dv = v[2] if len(v) == 3 else v[1] * v[3]
        if _has(node, 6):  # past_key [B,N,P,H]
            total += t.need(node.input[6])[2]
        if _has(node, 3):
            bias = batch * (seq * d + total * (d + dv))
    macs = projection + batch * seq * total * (d + dv)  # QKᵀ and attention·V over all heads
    return macs, 2 * macs + bias + _SCORE_FLOPS * batch * heads * seq * total


def _einsum(node: onnx.NodeProto, attrs: dict, t: _Tensors) -> tuple[int, int]:
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


def _bytes(node: onnx.NodeProto, t: _Tensors) -> int:
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


def _precision(node: onnx.NodeProto, t: _Tensors) -> str:
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


def _has(node: onnx.NodeProto, index: int | None) -> bool:
    return index is not None and len(node.input) > index and bool(node.input[index])


def _common(values: set[str]) -> str | None:
    return next(iter(values)) if len(values) == 1 else ("mixed" if values else None)


_CONV_ATTRS = {"auto_pad", "dilations", "group", "kernel_shape", "pads", "strides"}
_NAMELESS = onnx.ModelProto(graph=onnx.GraphProto(name="model"))  # for _macs' messages


# ---------------------------------------------------------------------------- shapes
class _Tensors:
    """Static shape (None when unknown) and element type of every tensor name."""

    def __init__(self, table: dict[str, tuple[Shape | None, int]], model: onnx.ModelProto) -> None:
        self.shapes = {name: shape for name, (shape, _) in table.items()}
        self.elems = {name: elem for name, (_, elem) in table.items()}
        self.consts = {t.name: t for t in model.graph.initializer if math.prod(t.dims) <= 64}
        # DequantizeLinear output -> element type of the integers it dequantizes
        self.dequantized = {
            node.output[0]: self.elems.get(node.input[0])
            for node in model.graph.node
            if node.op_type == "DequantizeLinear"
        }
        for node in model.graph.node:
            for attr in node.attribute:
                if node.op_type == "Constant" and attr.name == "value":
                    self.consts[node.output[0]] = attr.t

    def need(self, name: str) -> Shape:
        shape = self.shapes.get(name)
        if shape is None:
            raise _UnknownShape(name)
        return shape

    def numel(self, name: str) -> int:
        return math.prod(self.need(name))

    def numel_or_none(self, name: str) -> int | None:
        shape = self.shapes.get(name)
        return None if shape is None else math.prod(shape)

    def elem(self, name: str) -> int:
        return self.elems.get(name, TensorProto.UNDEFINED)

    def itemsize(self, name: str) -> float | None:
        return _itemsize(self.elem(name))

    def nbytes(self, name: str) -> int | None:
        count, size = self.numel_or_none(name), self.itemsize(name)
        return None if count is None or size is None else math.ceil(count * size)

    def fill_outputs(self, node: onnx.NodeProto, model: onnx.ModelProto) -> None:
        """Shapes ONNX inference left unknown, from Kiln's rules (needs the inputs' shapes)."""
        if all(self.shapes.get(o) is not None for o in node.output if o):
            return
        try:
            if node.domain == "com.microsoft":
                inferred = _contrib_outputs(node, self)
            elif node.domain in ("", "ai.onnx"):
                inferred = _onnx_outputs(node, self, model)
            else:
                return
        except _INFERENCE_ERRORS:
            return  # left unknown: the node's cost says so
        for name, (shape, elem) in inferred.items():
            if name and self.shapes.get(name) is None:
                self.shapes[name], self.elems[name] = shape, elem


_INFERENCE_ERRORS = (
    _UnknownShape,
    KeyError,
    IndexError,
    ValueError,
    TypeError,
    onnx.shape_inference.InferenceError,
    onnx.defs.SchemaError,
)


def _known_tensors(model: onnx.ModelProto, dims: Mapping[str, int]) -> _Tensors:
    """Shapes from ONNX inference and the model's value_info, completed by Kiln's rules for
    the ops ONNX does not know. A shape those rules find can make shape arithmetic further on
    constant (Shape → Slice → Concat → Reshape), so inference runs again with it as a hint,
    while that helps, for a few rounds at most."""
    outputs = [name for node in model.graph.node for name in node.output if name]
    hints: list[onnx.ValueInfoProto] = []
    for _ in range(4):
        tensors = _Tensors(_tensor_table(model, dims, hints), model)
        for node in model.graph.node:
            tensors.fill_outputs(node, model)
        found = [
            helper.make_tensor_value_info(name, tensors.elem(name), tensors.shapes[name])
            for name in outputs
            if tensors.shapes.get(name) is not None and tensors.elem(name)
        ]
        if len(found) == len(outputs) or len(found) <= len(hints):
            break
        hints = found
    return tensors


def _tensor_table(
    model: onnx.ModelProto, dims: Mapping[str, int], hints: list[onnx.ValueInfoProto]
) -> dict:
    """name -> (static shape or None, elem type): ONNX inference first, then the model's own
    value_info (with symbolic dims fixed), then initializers."""
    table: dict[str, tuple[Shape | None, int]] = {}
    for graph, fix in ((_infer(model, dims, hints).graph, {}), (model.graph, dims)):
        for vi in [*graph.input, *graph.value_info, *graph.output]:
            if table.get(vi.name, (None, 0))[0] is None and vi.type.HasField("tensor_type"):
                table[vi.name] = (_static(vi.type.tensor_type, fix), vi.type.tensor_type.elem_type)
        for init in graph.initializer:
            table[init.name] = (list(init.dims), init.data_type)
    for node in model.graph.node:  # Constant nodes ONNX inference folded away
        if node.op_type == "Constant" and node.output[0] not in table:
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            if value is not None:
                table[node.output[0]] = (list(value.dims), value.data_type)
    return table


def _static(tensor_type: onnx.TypeProto.Tensor, dims: Mapping[str, int]) -> Shape | None:
    if not tensor_type.HasField("shape"):
        return None
    shape = []
    for d in tensor_type.shape.dim:
        if d.HasField("dim_value") and d.dim_value >= 0:  # some exporters write -1
            shape.append(d.dim_value)
        elif d.dim_param in dims:
            shape.append(int(dims[d.dim_param]))
        else:
            return None
    return shape


def _itemsize(elem: int) -> float | None:
    if elem in (TensorProto.INT4, TensorProto.UINT4, getattr(TensorProto, "FLOAT4E2M1", -1)):
        return 0.5
    try:
        return float(np.dtype(helper.tensor_dtype_to_np_dtype(elem)).itemsize)
    except (KeyError, TypeError, ValueError):
        return None  # undefined or string tensors


def _contrib_outputs(node: onnx.NodeProto, t: _Tensors) -> dict[str, tuple[Shape, int]]:
    """Output shapes of the com.microsoft ops Kiln's fusions and ORT's quantizer emit."""
    op, out = node.op_type, list(node.output)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    x, elem = t.need(node.input[0]), t.elem(node.input[0])
    if op in ("SkipLayerNormalization", "SkipSimplifiedLayerNormalization"):
        stats = (x[:-1] + [1], TensorProto.FLOAT)  # mean and inverse std-dev
        return dict(zip(out, [(x, elem), stats, stats, (x, elem)], strict=False))
    if op in ("BiasGelu", "FastGelu", "Gelu", "QuickGelu", "BiasAdd"):
        return {out[0]: (x, elem)}
    if op in ("Attention", "QAttention"):
        w = t.need(node.input[1])
        dv = (attrs.get("qkv_hidden_sizes") or [w[1] // 3] * 3)[2]
        return {out[0]: (x[:2] + [dv], elem if op == "Attention" else TensorProto.FLOAT)}
    if op == "MultiHeadAttention":
        if _has(node, 2):
            v = t.need(node.input[2])
            dv = v[2] if len(v) == 3 else v[1] * v[3]
        elif _has(node, 1) and len(t.need(node.input[1])) == 5:
            k = t.need(node.input[1])
            dv = k[2] * k[4]
        else:
            dv = x[2] if len(x) == 3 else x[2] * x[4]
        return {out[0]: (x[:2] + [dv], elem)}
    if op == "FusedConv":
        conv = helper.make_node("Conv", list(node.input[:2]), [out[0]])
        conv.attribute.extend(a for a in node.attribute if a.name in _CONV_ATTRS)
        return _onnx_outputs(conv, t, None)
    if op == "MatMulNBits":
        return {out[0]: (x[:-1] + [attrs["N"]], elem)}
    if op in ("FusedMatMul", "DynamicQuantizeMatMul", "MatMulIntegerToFloat"):
        b = t.need(node.input[1])
        m = x[-1] if attrs.get("transA") else x[-2]
        n = b[-2] if attrs.get("transB") else b[-1]
        batch = np.broadcast_shapes(tuple(x[:-2]), tuple(b[:-2]))
        return {out[0]: ([*batch, m, n], TensorProto.FLOAT)}
    if op == "EmbedLayerNormalization":
        hidden = t.need(node.input[2])[1]  # word_embedding [vocab, hidden]
        types = [(x + [hidden], TensorProto.FLOAT), ([x[0]], TensorProto.INT32)]
        return dict(zip(out, types, strict=False))  # optional outputs may be left off
    return {}


def _onnx_outputs(
    node: onnx.NodeProto, t: _Tensors, model: onnx.ModelProto | None
) -> dict[str, tuple[Shape, int]]:
    """ONNX's own inference for one node of the default domain, from known input types."""
    opset = 17
    if model is not None:
        opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
    schema = onnx.defs.get_schema(node.op_type, opset, "")
    types = {}
    for name in node.input:
        if name:
            types[name] = helper.make_tensor_type_proto(t.elem(name), t.need(name))
    # Small constants (shapes, axes) let it infer Reshape, Unsqueeze, Slice and the like.
    data = {name: t.consts[name] for name in node.input if name in t.consts}
    result = onnx.shape_inference.infer_node_outputs(schema, node, types, data)
    out = {}
    for name, tp in result.items():
        shape = _static(tp.tensor_type, {})
        if shape is not None:
            out[name] = (shape, tp.tensor_type.elem_type)
    return out
