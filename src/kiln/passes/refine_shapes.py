"""Name the dims that ONNX shape inference loses, so fusion checks can match shapes.

ONNX shape inference cannot follow `Slice(table, 0, Shape(x)[i])`, `Range(0, Shape(x)[i])`
(position ids in BERT and GPT-2 exports) or `Reshape(x, Concat(Shape(x)[0], Shape(x)[1], -1,
64))` (heads in PyTorch exports): it invents a fresh dim, every broadcast with it invents more,
and fusion rules that require Q, K and V or the residual and the branch to share dims give up.
This pass states what those ops produce and re-infers.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common as common

from kiln.ir.onnxscript_internals import get_numpy_value
from kiln.passes.base import KilnPass

Dim = ir.SymbolicDim | int


def _dims(value: ir.Value | None) -> list[Dim] | None:
    """The dims a 1-D int64 value holds, when it is built from shapes and constants:
    Shape(x, start, end), Concat of such, Gather of such at constant indices, constants."""
    if value is None:
        return None
    array = get_numpy_value(value)
    if array is not None:
        return [int(x) for x in array.reshape(-1)] if array.ndim <= 1 else None
    node = value.producer()
    if node is None:
        return None
    if node.op_type == "Shape" and node.inputs[0] is not None and node.inputs[0].shape:
        rank = node.inputs[0].shape.rank()
        start, end = node.attributes.get_int("start", 0), node.attributes.get_int("end", rank)
        return list(node.inputs[0].shape)[slice(start, end)]
    if node.op_type == "Concat":
        parts = [_dims(v) for v in node.inputs]
        return None if any(p is None for p in parts) else [d for p in parts for d in p]
    if node.op_type == "Gather":
        source, index = _dims(node.inputs[0]), get_numpy_value(node.inputs[1])
        if source is None or index is None:
            return None
        try:
            return [source[int(i)] for i in index.reshape(-1)]
        except IndexError:
            return None
    if node.op_type in ("Unsqueeze", "Squeeze", "Cast", "Reshape", "Identity"):
        return _dims(node.inputs[0])
    return None


def _dim_of(value: ir.Value | None) -> Dim | None:
    """The one dim a scalar or [1] value holds."""
    dims = _dims(value)
    return dims[0] if dims is not None and len(dims) == 1 else None


def _is(value: ir.Value | None, number: int) -> bool:
    array = get_numpy_value(value) if value is not None else None
    return array is not None and array.size == 1 and bool(np.all(array == number))


def _reshape_target(node: ir.Node) -> ir.Shape | None:
    """Reshape to dims read from shapes and constants: name the dims, solve one -1."""
    data, target = node.inputs[0], node.inputs[1]
    if data is None or data.shape is None or get_numpy_value(target) is not None:
        return None
    dims = _dims(target)
    if dims is None:
        return None
    if any(isinstance(d, int) and d == 0 for d in dims) or dims.count(-1) > 1:
        return None
    if -1 in dims:
        symbolic_in = sorted(str(d) for d in data.shape if not isinstance(d, int))
        symbolic_out = sorted(str(d) for d in dims if not isinstance(d, int))
        if symbolic_in != symbolic_out:
            return None
        size_in = int(np.prod([d for d in data.shape if isinstance(d, int)]))
        size_out = -int(np.prod([d for d in dims if isinstance(d, int)]))
        if size_out <= 0 or size_in % size_out:
            return None
        dims[dims.index(-1)] = size_in // size_out
    return ir.Shape(dims)


def _known_shape(node: ir.Node) -> ir.Shape | None:
    if node.op_type == "Reshape" and len(node.inputs) == 2:
        return _reshape_target(node)
    if node.op_type == "Range" and _is(node.inputs[0], 0) and _is(node.inputs[2], 1):
        dim = _dim_of(node.inputs[1])
        return ir.Shape([dim]) if dim is not None else None
    if node.op_type == "Slice" and len(node.inputs) >= 4 and node.inputs[0].shape is not None:
        if len(node.inputs) > 4 and node.inputs[4] is not None and not _is(node.inputs[4], 1):
            return None
        axes = get_numpy_value(node.inputs[3])
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
    """Guarantee: the computation is untouched; only shape annotations change.

    States shapes of main-graph nodes only; If/Loop/Scan bodies keep the shapes ONNX
    inference gives them (a Loop body's values may change shape from one iteration to the
    next, so no dim is named there)."""

    name = "refine-shapes"
    stage = "simplify"
    summary = "Name dims ONNX inference loses (position-id Slice/Range), then re-infer."

    def apply(self, model: ir.Model, rounds: int = 4) -> int:
        """Returns how many values' shapes changed (0 when every stated shape was known)."""
        before = _shapes(model)
        # Each round can only name dims whose sources were named by the round before.
        stated: dict[int, str] = {}
        for _ in range(rounds):
            known = {id(n): s for n in model.graph if (s := _known_shape(n)) is not None}
            if all(stated.get(key) == str(shape) for key, shape in known.items()):
                break
            stated = {key: str(shape) for key, shape in known.items()}
            outputs = {id(v) for v in model.graph.outputs}
            for node in model.graph:
                if node.domain in ("", "ai.onnx"):
                    for value in node.outputs:
                        if id(value) not in outputs:
                            value.shape = None
                if id(node) in known:
                    node.outputs[0].shape = known[id(node)]
            common.ShapeInferencePass()(model)
        return sum(before.get(value) != shape for value, shape in _shapes(model).items())


def _shapes(model: ir.Model) -> dict[ir.Value, str]:
    return {value: str(value.shape) for node in model.graph for value in node.outputs}
