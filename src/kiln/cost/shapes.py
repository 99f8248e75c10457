"""Static shapes and element types of every tensor of an ONNX model, for costing it.

The model is never run and never mutated. Symbolic input dims are fixed from ``dims`` (else the
model's ``kiln.dims`` metadata) on a weight-less copy; onnxscript's constant folding and ONNX
shape inference (with data propagation) supply the shapes; then the model's own value_info
(compiled artifacts carry it) and Kiln's rules for the com.microsoft ops ONNX does not know.
A shape those rules find is fed back to ONNX inference as a hint, which can then resolve shape
arithmetic downstream. A shape that stays unknown is ``None``: the cost of the nodes that
need it says so, rather than the whole model being refused.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir
import onnxscript.optimizer
from onnx import TensorProto, helper

from kiln.errors import KilnError

Shape = list[int]

_KEEP_ELEMENTS = 4096  # initializers up to this size stay (shape constants); bigger become inputs
_CONST_ELEMENTS = 64  # constants up to this size are handed to ONNX's per-node inference
_HINT_ROUNDS = 4  # inference re-runs with Kiln's shapes as hints, while that helps
_CONV_ATTRS = {"auto_pad", "dilations", "group", "kernel_shape", "pads", "strides"}


class UnknownShape(Exception):
    """A shape a cost formula needs is not known statically (the tensor name is the arg)."""


class Tensors:
    """Static shape (None when unknown) and element type of every tensor name of one model."""

    def __init__(self, table: dict[str, tuple[Shape | None, int]], model: onnx.ModelProto) -> None:
        self.shapes = {name: shape for name, (shape, _) in table.items()}
        self.elems = {name: elem for name, (_, elem) in table.items()}
        self.consts = {
            t.name: t for t in model.graph.initializer if math.prod(t.dims) <= _CONST_ELEMENTS
        }
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
        """The static shape of ``name``; raises UnknownShape when it is not known."""
        shape = self.shapes.get(name)
        if shape is None:
            raise UnknownShape(name)
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
    UnknownShape,
    KeyError,
    IndexError,
    ValueError,
    TypeError,
    onnx.shape_inference.InferenceError,
    onnx.defs.SchemaError,
)


def has_input(node: onnx.NodeProto, index: int | None) -> bool:
    """Whether optional input ``index`` of ``node`` is given (None: the op has no such input)."""
    return index is not None and len(node.input) > index and bool(node.input[index])


def resolve_dims(model: onnx.ModelProto, dims: Mapping[str, int] | None) -> dict[str, int]:
    """``dims`` over the model's ``kiln.dims`` metadata (malformed metadata is ignored: the
    caller's dims must then cover every symbolic dim)."""
    resolved: dict[str, int] = {}
    for prop in model.metadata_props:
        if prop.key == "kiln.dims":
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                resolved.update({str(k): int(v) for k, v in json.loads(prop.value).items()})
    resolved.update(dims or {})
    return resolved


def known_tensors(model: onnx.ModelProto, dims: Mapping[str, int]) -> Tensors:
    """Shapes from ONNX inference and the model's value_info, completed by Kiln's rules for
    the ops ONNX does not know. A shape those rules find can make shape arithmetic further on
    constant (Shape → Slice → Concat → Reshape), so inference runs again with it as a hint,
    while that helps, for a few rounds at most.

    Raises KilnError when a symbolic input dim has no value in ``dims``, or when ONNX shape
    inference rejects the model."""
    outputs = [name for node in model.graph.node for name in node.output if name]
    hints: list[onnx.ValueInfoProto] = []
    for _ in range(_HINT_ROUNDS):
        tensors = Tensors(_tensor_table(model, dims, hints), model)
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
) -> dict[str, tuple[Shape | None, int]]:
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


def _infer(
    model: onnx.ModelProto,
    dims: Mapping[str, int],
    hints: Sequence[onnx.ValueInfoProto] = (),
) -> onnx.ModelProto:
    """A copy of the graph with big weights turned into typed inputs, dims fixed, shapes inferred.

    Dropping the weight bytes keeps this fast on models of hundreds of megabytes. ``hints``
    are shapes known from elsewhere (value_info), e.g. of ops ONNX cannot infer.
    """
    copy = _weightless_copy(model, dims, hints)
    # ONNX shape inference cannot see through shape arithmetic such as exported position ids
    # (Slice(buffer, 0, Unsqueeze(Gather(Shape(ids), 1)))); folding those constants first lets it.
    # A second round folds what the first round's shapes made constant (Shape → Slice → Concat
    # → Reshape chains, as paddle2onnx writes them).
    for _ in range(2):
        try:
            folded = ir.from_proto(copy)
            onnxscript.optimizer.fold_constants(folded)
            copy = ir.to_proto(folded)
        except Exception:  # noqa: BLE001 - folding only helps; plain inference may still suffice
            pass
        try:
            copy = onnx.shape_inference.infer_shapes(copy, strict_mode=False, data_prop=True)
        except onnx.shape_inference.InferenceError as exc:
            raise KilnError(f"model {model.graph.name!r}: shape inference failed: {exc}") from exc
        if _all_shapes_static(copy):
            break
    return copy


def _weightless_copy(
    model: onnx.ModelProto, dims: Mapping[str, int], hints: Sequence[onnx.ValueInfoProto]
) -> onnx.ModelProto:
    """The main graph with symbolic input dims fixed and big (or external) weights turned into
    typed inputs; KilnError naming every symbolic dim ``dims`` leaves without a value."""
    src = model.graph
    init_names = {t.name for t in src.initializer}
    graph = onnx.GraphProto(name=src.name)
    graph.node.extend(src.node)
    graph.value_info.extend(hints)
    for out in src.output:  # declared output shapes may be symbolic: let inference decide
        if out.type.HasField("tensor_type"):
            out = helper.make_tensor_value_info(out.name, out.type.tensor_type.elem_type, None)
        graph.output.append(out)
    missing: list[str] = []
    for vi in src.input:
        if vi.name in init_names:
            continue
        vi = graph.input.add(name=vi.name, type=vi.type)
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_param"):
                if d.dim_param in dims:
                    d.dim_value = int(dims[d.dim_param])  # clears dim_param (a oneof)
                elif d.dim_param not in missing:
                    missing.append(d.dim_param)
    if missing:
        raise KilnError(
            f"model {src.name!r}: no value for symbolic dim(s) {', '.join(missing)}; "
            f"pass them in dims, e.g. {{{', '.join(repr(m) + ': 1' for m in missing)}}}"
        )
    for t in src.initializer:
        external = t.data_location == TensorProto.EXTERNAL
        if not external and math.prod(t.dims) <= _KEEP_ELEMENTS:
            graph.initializer.append(t)
        else:
            graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    copy = onnx.ModelProto(ir_version=max(model.ir_version, 4), graph=graph)
    copy.opset_import.extend(model.opset_import)
    # ONNX Runtime accepts contrib-op domains that are not declared (its transformers optimizer
    # writes such models); ONNX inference refuses them.
    declared = {o.domain for o in model.opset_import}
    for domain in sorted({n.domain for n in src.node} - declared - {"", "ai.onnx"}):
        copy.opset_import.append(helper.make_opsetid(domain, 1))
    copy.functions.extend(model.functions)
    return copy


def _all_shapes_static(model: onnx.ModelProto) -> bool:
    known: dict[str, bool] = {}
    g = model.graph
    for vi in [*g.input, *g.value_info, *g.output]:
        tensor_type = vi.type.tensor_type
        known[vi.name] = tensor_type.HasField("shape") and all(
            d.HasField("dim_value") and d.dim_value >= 0 for d in tensor_type.shape.dim
        )
    known.update({init.name: True for init in g.initializer})
    return all(known.get(o, False) for node in g.node for o in node.output if o)


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


# ---------------------------------------------------------------------------- per-node rules
def _contrib_outputs(node: onnx.NodeProto, t: Tensors) -> dict[str, tuple[Shape, int]]:
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
        return {out[0]: (x[:2] + [_mha_value_width(node, t, x)], elem)}
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


def _mha_value_width(node: onnx.NodeProto, t: Tensors, query: Shape) -> int:
    """Width of MultiHeadAttention's output: V's (3-D or BNSH), packed KV's, or packed Q's."""
    if has_input(node, 2):
        v = t.need(node.input[2])
        return v[2] if len(v) == 3 else v[1] * v[3]
    if has_input(node, 1) and len(t.need(node.input[1])) == 5:
        k = t.need(node.input[1])
        return k[2] * k[4]
    return query[2] if len(query) == 3 else query[2] * query[4]


def _onnx_outputs(
    node: onnx.NodeProto, t: Tensors, model: onnx.ModelProto | None
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
