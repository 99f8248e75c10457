"""FLOPs of an ONNX model's multiply-accumulate operators, from shapes alone.

Counted: MatMul, Gemm, Conv (grouped, depthwise and N-D included) and ConvTranspose of the
default ONNX domain in the main graph, at 2 FLOPs per multiply-accumulate. Everything else
(bias adds, normalisations, activations, Softmax, pooling, elementwise ops) is *not* counted,
nor are nodes in other domains or inside control-flow subgraphs. The model is never run:
its symbolic input dims are fixed to the given values on a weight-less copy and ONNX shape
inference (with data propagation) supplies every other shape.
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

MAC_OPS = ("MatMul", "Gemm", "Conv", "ConvTranspose")
_KEEP_ELEMENTS = 4096  # initializers up to this size stay (shape constants); bigger become inputs


def count_flops(model: onnx.ModelProto, dims: Mapping[str, int] | None = None) -> int:
    """Total FLOPs (2 per multiply-accumulate) of MatMul/Gemm/Conv/ConvTranspose.

    ``dims`` gives a value to each symbolic input dim (e.g. ``{"batch": 1, "seq": 128}``);
    dims it leaves out are taken from the model's ``kiln.dims`` metadata when present.
    """
    return sum(count_flops_by_node(model, dims).values())


def count_flops_by_op(
    model: onnx.ModelProto, dims: Mapping[str, int] | None = None
) -> dict[str, int]:
    """FLOPs per operator type (only the counted MAC operators appear)."""
    out: dict[str, int] = {}
    for _, node, flops in _node_flops(model, dims):
        out[node.op_type] = out.get(node.op_type, 0) + flops
    return out


def count_flops_by_node(
    model: onnx.ModelProto, dims: Mapping[str, int] | None = None
) -> dict[str, int]:
    """FLOPs per counted node, keyed by node name (``#index:OpType`` for unnamed nodes, the
    index being the node's position in the graph, as in :func:`kiln.cost.node_costs`)."""
    return {
        node.name or f"#{i}:{node.op_type}": flops for i, node, flops in _node_flops(model, dims)
    }


# ---------------------------------------------------------------------------- internals
def _node_flops(
    model: onnx.ModelProto, dims: Mapping[str, int] | None
) -> list[tuple[int, onnx.NodeProto, int]]:
    """(index in the graph, node, FLOPs) of every counted node."""
    inferred = _infer(model, _resolve_dims(model, dims))
    shapes = _shapes(inferred)
    for t in model.graph.initializer:  # in case folding consumed one
        shapes.setdefault(t.name, list(t.dims))
    result = []
    for i, node in enumerate(model.graph.node):
        if node.op_type in MAC_OPS and node.domain in ("", "ai.onnx"):
            result.append((i, node, 2 * _macs(node, shapes, model)))
    return result


def _resolve_dims(model: onnx.ModelProto, dims: Mapping[str, int] | None) -> dict[str, int]:
    resolved: dict[str, int] = {}
    for prop in model.metadata_props:
        if prop.key == "kiln.dims":
            # malformed metadata is ignored: the caller's dims must then cover everything
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                resolved.update({str(k): int(v) for k, v in json.loads(prop.value).items()})
    resolved.update(dims or {})
    return resolved


def _infer(
    model: onnx.ModelProto,
    dims: Mapping[str, int],
    hints: Sequence[onnx.ValueInfoProto] = (),
) -> onnx.ModelProto:
    """A copy of the graph with big weights turned into typed inputs, dims fixed, shapes inferred.

    Dropping the weight bytes keeps this fast on models of hundreds of megabytes. ``hints``
    are shapes known from elsewhere (value_info), e.g. of ops ONNX cannot infer.
    """
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
            raise KilnError(f"model {src.name!r}: shape inference failed: {exc}") from exc
        if _all_shapes_static(copy):
            break
    return copy


def _all_shapes_static(model: onnx.ModelProto) -> bool:
    shapes = _shapes(model)
    return all(shapes.get(o) is not None for node in model.graph.node for o in node.output if o)


def _shapes(model: onnx.ModelProto) -> dict[str, list[int] | None]:
    shapes: dict[str, list[int] | None] = {}
    g = model.graph
    for vi in [*g.input, *g.value_info, *g.output]:
        t = vi.type.tensor_type
        if not t.HasField("shape"):
            shapes[vi.name] = None
            continue
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]
        shapes[vi.name] = None if any(d < 0 for d in dims) else dims
    for init in g.initializer:
        shapes[init.name] = list(init.dims)
    return shapes


def _macs(
    node: onnx.NodeProto, shapes: Mapping[str, list[int] | None], model: onnx.ModelProto
) -> int:
    def shape(i: int, of: str = "input") -> list[int]:
        name = (node.input if of == "input" else node.output)[i]
        s = shapes.get(name)
        if s is None:
            raise KilnError(
                f"model {model.graph.name!r}: cannot count FLOPs of node {node.name!r} "
                f"({node.op_type}): the shape of {name!r} is unknown after shape inference"
            )
        return s

    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "MatMul":
        a, b = shape(0), shape(1)
        a = [1, *a] if len(a) == 1 else a
        b = [*b, 1] if len(b) == 1 else b
        batch = np.broadcast_shapes(tuple(a[:-2]), tuple(b[:-2]))
        return math.prod(batch) * a[-2] * a[-1] * b[-1]
    if node.op_type == "Gemm":
        a, b = shape(0), shape(1)
        m, k = (a[1], a[0]) if attrs.get("transA", 0) else (a[0], a[1])
        n = b[0] if attrs.get("transB", 0) else b[1]
        return m * k * n
    if node.op_type == "Conv":  # each output element: (C_in / group) · prod(kernel) MACs
        return math.prod(shape(0, "output")) * math.prod(shape(1)[1:])
    # ConvTranspose: each input element scatters to (C_out / group) · prod(kernel) outputs
    return math.prod(shape(0)) * math.prod(shape(1)[1:])
