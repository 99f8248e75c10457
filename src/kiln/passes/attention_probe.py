"""Prove that an attention block computes com.microsoft Attention, by running both.

The block (every node from its input activations and the graph's mask input to its output)
is cut out and run under ONNX Runtime beside the candidate Attention node, on random
activations and a random 0/1 padding mask, once bidirectional and once causal. A layout
the structural walk misread, a mask that is not a padding or causal mask, a scale put
elsewhere: any of them shows up as a different output, and the block is left alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
import onnx_ir as ir

from kiln.passes.attention_trace import NotAttention

BATCH, SEQ = 2, 7  # probe shape; 7 matches no head count or head size of a real model
MAX_NODES = 400  # more than this reads values computed before the block's input
TOLERANCE = 1e-4


@dataclass
class Candidate:
    x: ir.Value
    weight: np.ndarray  # [in, 3·hidden], Q | K | V
    bias: np.ndarray
    heads: int
    scale: float
    mask: ir.Value | None  # the graph's 2-D padding mask input, when the block reads it
    block: list[ir.Node] = field(default_factory=list)  # every node the fused op replaces


def causal_flag(model: ir.Model, root: ir.Value, candidate: Candidate) -> int:
    """0 or 1: the `unidirectional` under which Attention gives the block's output. Raises
    NotAttention naming the difference when neither does."""
    nodes, probe_inputs = _block(model, root, candidate.x)
    masks = [v for v in probe_inputs if v is not candidate.x and _is_mask(v)]
    if len(masks) > 1:
        raise NotAttention("the block reads more than one mask input")
    candidate.mask = masks[0] if masks else None
    candidate.block = nodes
    feeds = _feeds(probe_inputs, candidate)
    proto = _probe_model(model, nodes, probe_inputs, root, candidate)
    outputs = _run(proto, feeds)
    want = outputs[0]
    differences = []
    for flag, got in enumerate(outputs[1:]):
        got = got.reshape(want.shape)
        difference = float(np.max(np.abs(got - want)))
        if difference <= TOLERANCE * max(1.0, float(np.max(np.abs(want)))):
            return flag
        differences.append(difference)
    raise NotAttention(
        "the block does not compute Attention with these projections "
        f"(max difference {min(differences):.3g} on a probe)"
    )


def _is_mask(value: ir.Value) -> bool:
    from kiln.ir.inputs import is_mask_input

    return value.shape is not None and value.shape.rank() == 2 and is_mask_input(value.name)


def _block(model: ir.Model, root: ir.Value, x: ir.Value) -> tuple[list[ir.Node], list[ir.Value]]:
    """The nodes computing `root` from `x`, graph inputs and constants, in graph order, and
    the values the probe feeds. A Shape of a value outside the block becomes a fed input."""
    after_x = _downstream(model, x)
    graph_inputs = set(model.graph.inputs)
    nodes: set[ir.Node] = set()
    inputs: list[ir.Value] = []
    stack, seen = [root], set()
    while stack:
        value = stack.pop()
        if value is None or value in seen:
            continue
        seen.add(value)
        node = value.producer()
        if value is x or value in graph_inputs:
            inputs.append(value)
            continue
        if node is None:
            if value.const_value is None:
                raise NotAttention(f"the block reads {value.name}, which the probe cannot feed")
            continue
        if node.op_type == "Shape" and node.inputs[0] not in after_x:
            if node.inputs[0] not in seen:
                seen.add(node.inputs[0])
                inputs.append(node.inputs[0])
            nodes.add(node)
            continue
        if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
               for a in node.attributes.values()):  # fmt: skip
            raise NotAttention(f"the block holds control flow ({node.op_type} {node.name})")
        nodes.add(node)
        if len(nodes) > MAX_NODES:
            raise NotAttention("the block reads values computed before its input")
        stack.extend(node.inputs)
    if x not in inputs:
        raise NotAttention("the block does not read the projections' input")
    return [n for n in model.graph if n in nodes], inputs


def _downstream(model: ir.Model, x: ir.Value) -> set[ir.Value]:
    reached = {x}
    for node in model.graph:
        if any(v in reached for v in node.inputs):
            reached.update(node.outputs)
    return reached


def _feeds(inputs: list[ir.Value], candidate: Candidate) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    dims: dict[str, int] = {}
    for value in inputs:
        if value is candidate.x or value is candidate.mask:
            for dim, size in zip(value.shape or [], (BATCH, SEQ), strict=False):
                if not isinstance(dim, int):
                    dims[str(dim)] = size
    feeds = {}
    for value in inputs:
        dtype = value.dtype.numpy() if value.dtype is not None else None
        shape = [d if isinstance(d, int) else dims.get(str(d)) for d in value.shape or []]
        if dtype is None or value.shape is None or None in shape:
            raise NotAttention(f"the block reads {value.name}, whose shape the probe cannot tell")
        if value is candidate.x:
            feeds[value.name] = rng.standard_normal(shape).astype(dtype)
        elif value is candidate.mask:
            keep = rng.integers(0, 2, size=shape)
            keep[:, 0] = 1  # no fully masked rows: engines differ there, as do exporters
            feeds[value.name] = keep.astype(dtype)
        else:
            feeds[value.name] = np.zeros(shape, dtype)
    return feeds


def _probe_model(
    model: ir.Model,
    nodes: list[ir.Node],
    inputs: list[ir.Value],
    root: ir.Value,
    candidate: Candidate,
) -> onnx.ModelProto:
    constants = {
        v.name: v
        for n in nodes
        for v in n.inputs
        if v is not None and v.producer() is None and v.const_value is not None
    }
    initializers = [ir.serde.serialize_tensor(v.const_value) for v in constants.values()]
    for name, tensor in zip(constants, initializers, strict=True):
        tensor.name = name
    weight = onnx.numpy_helper.from_array(candidate.weight.astype(np.float32), "kiln.probe.w")
    bias = onnx.numpy_helper.from_array(candidate.bias.astype(np.float32), "kiln.probe.b")
    attention_inputs = [candidate.x.name, weight.name, bias.name]
    graph_nodes = [ir.serde.serialize_node(n) for n in nodes]
    if candidate.mask is not None:
        graph_nodes.append(
            onnx.helper.make_node("Cast", [candidate.mask.name], ["kiln.probe.mask"], to=6)
        )
        attention_inputs.append("kiln.probe.mask")
    outputs = [root.name]
    for flag in (0, 1):
        outputs.append(f"kiln.probe.attention{flag}")
        graph_nodes.append(
            onnx.helper.make_node(
                "Attention",
                attention_inputs,
                [outputs[-1]],
                domain="com.microsoft",
                num_heads=candidate.heads,
                scale=candidate.scale,
                unidirectional=flag,
            )  # fmt: skip
        )
    graph = onnx.helper.make_graph(
        graph_nodes,
        "kiln.attention_probe",
        [onnx.helper.make_tensor_value_info(v.name, int(v.dtype), None) for v in inputs],
        [onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)
         for name in outputs],
        [*initializers, weight, bias],
    )  # fmt: skip
    opsets = dict(model.opset_imports) | {"com.microsoft": 1}
    return onnx.helper.make_model(
        graph, opset_imports=[onnx.helper.make_opsetid(d, v) for d, v in opsets.items()],
        ir_version=model.ir_version,
    )  # fmt: skip


def _run(proto: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    from kiln.backends import get_backend
    from kiln.backends.ort import OrtOptions
    from kiln.errors import KilnError

    try:
        exe = get_backend("ort").compile(ir.serde.deserialize_model(proto), OrtOptions("basic"))
        return exe.run(feeds)
    except (KilnError, Exception) as exc:  # noqa: BLE001 - a block the probe cannot run
        raise NotAttention(f"the probe could not run the block: {str(exc)[:200]}") from None
