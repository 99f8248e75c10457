"""One piece of a model: the nodes between given tensors, as a model of its own.

A partitioned artifact's parts and `kiln split`'s edge and server halves are such pieces. The
piece keeps every node's metadata (its `kiln.origin`, so provenance survives the cut), the
initializers its nodes read, and the opsets; the tensors it starts from become graph inputs
with the types and shapes the whole model gives them.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence

import onnx
import onnx_ir as ir

from kiln.errors import KilnError

# Initializers up to this size keep their data in the copy a piece is cut from (shape
# constants, for inference); larger ones are the model's own tensors, attached after.
KEEP_ELEMENTS = 4096


def extract(
    model: ir.Model, inputs: Sequence[str], outputs: Sequence[str], name: str | None = None
) -> ir.Model:
    """The nodes that compute `outputs` from `inputs` (and the model's initializers).

    Raises KilnError naming the tensor when a name is not in the graph, when `outputs` need a
    graph input not listed in `inputs` (the cut does not separate the graph), or when the cut
    crosses a control-flow body (a tensor defined inside an If/Loop/Scan)."""
    graph = model.graph
    values = _top_level_values(graph)
    for tensor in (*inputs, *outputs):
        if tensor not in values:
            inner = _subgraph_names(graph)
            if tensor in inner:
                raise KilnError(
                    f"'{tensor}' is inside a control-flow body ({inner[tensor]}); cut at a "
                    "tensor of the main graph."
                )
            raise KilnError(f"'{tensor}' is not a tensor of {graph.name or 'the model'}.")
    _needed_nodes(graph, set(inputs), outputs)  # the checks, on the caller's graph
    proto = _weightless(ir.serde.serialize_model(model))
    # Types of inner tensors; where inference fails they come from what the model states.
    with contextlib.suppress(Exception):
        proto = onnx.shape_inference.infer_shapes(proto)
    copy = ir.serde.deserialize_model(proto)
    g = copy.graph
    known = _top_level_values(g)
    needed = {id(n) for n in _needed_nodes(g, set(inputs), outputs)}
    nodes = [n for n in g if id(n) in needed]
    g.outputs.clear()  # the whole model's outputs: a tensor among them may start this piece
    new_inputs = [_as_input(g, known[name]) for name in inputs]
    used = {v.name for n in nodes for v in (*n.inputs, *captured(n)) if v is not None}
    initializers = [g.initializers.pop(k) for k in list(g.initializers) if k in used]
    for value in initializers:  # the model's own tensors: shared, never copied
        value.const_value = graph.initializers[value.name].const_value
    new_outputs = [known[name] for name in outputs]
    for value in (*new_inputs, *new_outputs):
        if value.type is None:
            raise KilnError(f"'{value.name}' has no known type: cannot make it a graph boundary.")
    g.remove(list(g), safe=False)
    piece = ir.Graph(
        new_inputs,
        new_outputs,
        nodes=nodes,
        initializers=initializers,
        opset_imports=dict(g.opset_imports),
        name=name or f"{g.name or 'model'}_part",
    )
    return ir.Model(
        piece,
        ir_version=copy.ir_version,
        producer_name=copy.producer_name,
        functions=list(copy.functions.values()),
    )


def _weightless(proto: onnx.ModelProto) -> onnx.ModelProto:
    """`proto` without the data of its larger initializers (the piece takes the model's own
    tensors): a piece must not hold a copy of every weight — a proto's parts keep all of it
    alive. Small ones (shape constants) stay for shape inference."""
    for tensor in proto.graph.initializer:
        if math.prod(tensor.dims) > KEEP_ELEMENTS:
            tensor.ClearField("raw_data")
            for field in ("float_data", "int32_data", "int64_data", "double_data",
                          "uint64_data", "string_data"):  # fmt: skip
                tensor.ClearField(field)
            del tensor.external_data[:]
            tensor.data_location = onnx.TensorProto.DEFAULT
    return onnx.ModelProto.FromString(proto.SerializeToString())  # compact: the data let go


def _as_input(graph: ir.Graph, value: ir.Value) -> ir.Value:
    """`value` as a graph input of the piece: itself when it is one already, else a fresh
    value of the same name, type and shape that its readers now read."""
    if value.producer() is None and value.name not in graph.initializers:
        graph.inputs.remove(value)
        return value
    fresh = ir.Value(name=value.name, type=value.type, shape=value.shape)
    ir.convenience.replace_all_uses_with(value, fresh)
    value.name = f"{value.name}__cut"  # the name now belongs to the piece's input
    return fresh


def _top_level_values(graph: ir.Graph) -> dict[str, ir.Value]:
    values = {v.name: v for v in graph.inputs if v.name}
    values |= {name: v for name, v in graph.initializers.items()}
    for node in graph:
        values |= {v.name: v for v in node.outputs if v.name}
    return values


def _subgraph_names(graph: ir.Graph) -> dict[str, str]:
    """Tensor name → the node whose control-flow body defines it."""
    found: dict[str, str] = {}
    for node in graph:
        for attr in node.attributes.values():
            bodies = []
            if attr.type == ir.AttributeType.GRAPH:
                bodies = [attr.value]
            elif attr.type == ir.AttributeType.GRAPHS:
                bodies = list(attr.value)
            for body in bodies:
                for inner in ir.traversal.RecursiveGraphIterator(body):
                    for v in inner.outputs:
                        found.setdefault(v.name, f"{node.op_type} '{node.name}'")
                for v in body.inputs:
                    found.setdefault(v.name, f"{node.op_type} '{node.name}'")
    return found


def _needed_nodes(graph: ir.Graph, inputs: set[str], outputs: Sequence[str]) -> list[ir.Node]:
    """The nodes between `inputs` and `outputs`; a graph input reached that is not in `inputs`
    means the cut leaves a path around it."""
    graph_inputs = {v.name for v in graph.inputs} - set(graph.initializers)
    seen: set[int] = set()
    order: list[ir.Node] = []
    producers = {v.name: node for node in graph for v in node.outputs}
    stack = [producers[o] for o in outputs if o not in inputs and o in producers]
    for o in outputs:
        if o in graph_inputs and o not in inputs:
            raise KilnError(f"output '{o}' is a graph input not among the cut's inputs.")
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        order.append(node)
        for value in (*node.inputs, *captured(node)):
            if value is None or not value.name or value.name in inputs:
                continue
            if value.name in graph_inputs:
                raise KilnError(
                    f"the cut does not separate the graph: '{node.name}' needs the model input "
                    f"'{value.name}', which is not among the cut's inputs {sorted(inputs)}."
                )
            if value.producer() is not None and value.name in producers:
                stack.append(producers[value.name])
    return order


def captured(node: ir.Node) -> list[ir.Value]:
    """Outer-scope values a control-flow body of `node` reads."""
    captured: list[ir.Value] = []
    for attr in node.attributes.values():
        bodies = (
            [attr.value]
            if attr.type == ir.AttributeType.GRAPH
            else list(attr.value)
            if attr.type == ir.AttributeType.GRAPHS
            else []
        )
        for body in bodies:
            local = {v.name for v in body.inputs} | set(body.initializers)
            for inner in ir.traversal.RecursiveGraphIterator(body):
                local |= {v.name for v in inner.outputs}
            for inner in ir.traversal.RecursiveGraphIterator(body):
                captured += [v for v in inner.inputs if v is not None and v.name not in local]
    return captured
