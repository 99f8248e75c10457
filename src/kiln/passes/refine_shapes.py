"""Name the dims that ONNX shape inference loses, so fusion checks can match shapes.

ONNX shape inference cannot follow `Slice(table, 0, Shape(x)[i])` or `Range(0, Shape(x)[i])`
(position ids in BERT and GPT-2 exports): it invents a fresh dim, every broadcast with it
invents more, and fusion rules that require the residual and the branch to share
[batch, seq, hidden] give up. This pass states what those ops produce and re-infers.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common
from onnxscript.rewriter import _ir_utils

from kiln.passes.base import KilnPass


def _dim_of(value: ir.Value | None) -> ir.SymbolicDim | int | None:
    """The input dim a scalar or [1] value is read from: Unsqueeze?(Gather(Shape(x), i))."""
    node = value.producer() if value is not None else None
    if node is None:
        return None
    if node.op_type in ("Unsqueeze", "Squeeze", "Cast", "Reshape"):
        return _dim_of(node.inputs[0])
    if node.op_type != "Gather":
        return None
    shape_node, index = node.inputs[0].producer(), _ir_utils.get_numpy_value(node.inputs[1])
    if shape_node is None or shape_node.op_type != "Shape" or index is None or index.size != 1:
        return None
    source = shape_node.inputs[0]
    if source is None or source.shape is None:
        return None
    position = shape_node.attributes.get_int("start", 0) + int(index.reshape(()))
    return (
        source.shape[position] if -source.shape.rank() <= position < source.shape.rank() else None
    )


def _is(value: ir.Value | None, number: int) -> bool:
    array = _ir_utils.get_numpy_value(value) if value is not None else None
    return array is not None and array.size == 1 and bool(np.all(array == number))


def _known_shape(node: ir.Node) -> ir.Shape | None:
    if node.op_type == "Range" and _is(node.inputs[0], 0) and _is(node.inputs[2], 1):
        dim = _dim_of(node.inputs[1])
        return ir.Shape([dim]) if dim is not None else None
    if node.op_type == "Slice" and len(node.inputs) >= 4 and node.inputs[0].shape is not None:
        if len(node.inputs) > 4 and node.inputs[4] is not None and not _is(node.inputs[4], 1):
            return None
        axes = _ir_utils.get_numpy_value(node.inputs[3])
        if not _is(node.inputs[1], 0) or axes is None or axes.size != 1:
            return None
        dim = _dim_of(node.inputs[2])
        if dim is None:
            return None
        dims = list(node.inputs[0].shape)
        dims[int(axes.reshape(()))] = dim
        return ir.Shape(dims)
    return None


class RefineShapesPass(KilnPass):
    """Guarantee: the computation is untouched; only shape annotations change."""

    name = "refine-shapes"
    stage = "simplify"
    summary = "Name dims ONNX inference loses (position-id Slice/Range), then re-infer."

    def apply(self, model: ir.Model) -> int:
        known = {id(n): s for n in model.graph if (s := _known_shape(n)) is not None}
        if not known:
            return 0
        outputs = {id(v) for v in model.graph.outputs}
        for node in model.graph:
            if node.domain in ("", "ai.onnx"):
                for value in node.outputs:
                    if id(value) not in outputs:
                        value.shape = None
            if id(node) in known:
                node.outputs[0].shape = known[id(node)]
        common.ShapeInferencePass()(model)
        return len(known)
