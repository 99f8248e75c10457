"""Compute only the rows an output keeps: move `Gather` along a token/row axis up the graph.

A classifier that reads one token (ViT's class token: `Gather(LayerNorm(x), 0, axis=1)`)
needs the last block's per-token work — output projection, LayerNorm, MLP, residuals — for
that token alone, yet the graph computes it for all of them. Moving the Gather above each
op that treats rows independently (elementwise ops, LayerNormalization over later axes,
MatMul by a matrix) until it reaches one that mixes rows (attention) removes that work.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common

from kiln.ir.onnxscript_internals import get_numpy_value
from kiln.passes.base import KilnPass

UNARY = {
    "Relu", "Erf", "Tanh", "Sigmoid", "Neg", "Sqrt", "Exp", "Log", "Abs", "Cast",
    "Identity", "Softplus", "Gelu", "LeakyRelu", "Elu", "Selu", "HardSigmoid", "Reciprocal",
}  # fmt: skip
BROADCASTING = {"Add", "Sub", "Mul", "Div", "Pow", "Max", "Min"}


def _gather_parts(node: ir.Node) -> tuple[ir.Value, np.ndarray, int] | None:
    data, index = node.inputs[0], node.inputs[1]
    array = get_numpy_value(index)
    if data is None or data.shape is None or array is None or array.ndim > 1:
        return None
    axis = node.attributes.get_int("axis", 0) % data.shape.rank()
    if np.any(array < 0):
        return None
    return index, array, axis


def _operand_axis(operand: ir.Value, out_rank: int, axis: int) -> int | None | bool:
    """Axis of `operand` aligned with output `axis` under broadcasting; None if it has none;
    False if its shape is unknown."""
    if operand.shape is None:
        return False
    aligned = axis - (out_rank - operand.shape.rank())
    return aligned if aligned >= 0 else None


class _Mover:
    """Builds the Gathers that move above `producer`, with names derived from it."""

    def __init__(self, producer: ir.Node, gather: ir.Node, index: ir.Value) -> None:
        self.producer, self.gather, self.index = producer, gather, index
        self.zero = None
        self.new: list[ir.Node] = []

    def gathered(self, value: ir.Value, axis: int) -> ir.Value:
        index = self.index
        if value.shape is not None and value.shape[axis] == 1:
            index = self._zero()  # a broadcast axis of size 1: its only row
        node = ir.node("Gather", [value, index], {"axis": axis}, name=self._name("Gather"))
        node.metadata_props.update(self.gather.metadata_props)
        self.new.append(node)
        return node.outputs[0]

    def _zero(self) -> ir.Value:
        if self.zero is None:
            shape = get_numpy_value(self.index).shape
            tensor = ir.tensor(np.zeros(shape, np.int64), name=self._name("zero"))
            self.zero = ir.node("Constant", [], {"value": tensor}, name=self._name("zero"))
            self.new.append(self.zero)
            self.zero = self.zero.outputs[0]
        return self.zero

    def _name(self, what: str) -> str:
        return f"{self.producer.name}.rows.{what}{len(self.new)}"


def _push(model: ir.Model, gather: ir.Node) -> bool:
    parts = _gather_parts(gather)
    if parts is None:
        return False
    index, array, axis = parts
    data = gather.inputs[0]
    if gather.outputs[0] in model.graph.outputs:
        return False  # its name is part of the interface
    producer = data.producer()
    if producer is None or producer.domain not in ("", "ai.onnx") or len(producer.outputs) != 1:
        return False
    if any(user is not gather for user, _ in data.uses()) or data in model.graph.outputs:
        return False
    op, rank = producer.op_type, data.shape.rank()
    keeps_axis = array.ndim == 1  # a scalar index drops the axis
    mover = _Mover(producer, gather, index)
    inputs = list(producer.inputs)
    attributes = dict(producer.attributes)
    if op in UNARY or (
        op == "Clip" and all(get_numpy_value(v) is not None for v in inputs[1:] if v is not None)
    ):
        inputs[0] = mover.gathered(inputs[0], axis)
    elif op in BROADCASTING:
        for i, operand in enumerate(inputs):
            aligned = _operand_axis(operand, rank, axis)
            if aligned is False:
                return False
            if aligned is not None:
                inputs[i] = mover.gathered(operand, aligned)
            # An operand without the axis aligns with trailing dims, which stay as they were.
    elif op == "LayerNormalization":
        norm_axis = producer.attributes.get_int("axis", -1) % rank
        if axis >= norm_axis:
            return False
        inputs[0] = mover.gathered(inputs[0], axis)
        if not keeps_axis:
            attributes["axis"] = ir.AttrInt64("axis", norm_axis - 1)
    elif op == "MatMul":
        weight = inputs[1]
        if weight is None or weight.shape is None or weight.shape.rank() != 2 or rank < 2:
            return False
        if axis >= rank - 1:
            return False
        inputs[0] = mover.gathered(inputs[0], axis)
    else:
        return False
    moved = ir.node(op, inputs, attributes, name=f"{producer.name}.rows", num_outputs=1)
    moved.metadata_props.update(producer.metadata_props)
    model.graph.insert_before(producer, [*mover.new, moved])
    moved.outputs[0].name = f"{producer.outputs[0].name}.rows"
    ir.convenience.replace_all_uses_with(gather.outputs[0], moved.outputs[0])
    model.graph.remove([gather, producer], safe=True)
    return True


def _merge_twin_gathers(model: ir.Model) -> None:
    """Several identical Gathers of one value become one, so the value has a single user."""
    seen: dict[tuple, ir.Node] = {}
    for node in [n for n in model.graph if n.op_type == "Gather" and not n.domain]:
        parts = _gather_parts(node)
        if parts is None:
            continue
        key = (id(node.inputs[0]), parts[1].tobytes(), parts[1].shape, parts[2])
        if key in seen:
            ir.convenience.replace_all_uses_with(node.outputs[0], seen[key].outputs[0])
            if node.outputs[0] not in model.graph.outputs:
                model.graph.remove(node, safe=True)
        else:
            seen[key] = node


class PruneRowsPass(KilnPass):
    """Guarantee: outputs unchanged; an op moves below a Gather only if it treats the
    gathered axis row by row.

    Skips If/Loop/Scan bodies: it moves main-graph Gathers only, and never one whose data
    has any other user, a body included."""

    name = "prune-rows"
    stage = "simplify"
    summary = "Move row Gathers (e.g. ViT's class token) up so unused rows are not computed."

    def apply(self, model: ir.Model) -> int:
        common.ShapeInferencePass()(model)  # both passes decide from shapes
        moves = 0
        changed = True
        while changed:
            changed = False
            _merge_twin_gathers(model)
            for node in [n for n in model.graph if n.op_type == "Gather" and not n.domain]:
                if _push(model, node):
                    moves += 1
                    changed = True
                    break
        return moves
