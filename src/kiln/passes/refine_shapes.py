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
    if node.op_type == "Where":
        return _ones_for_minus_one(node)
    return None


def _ones_for_minus_one(node: ir.Node) -> list[Dim] | None:
    """Where(Equal(t, -1), 1, t): TorchScript's way to turn a view's -1 into Expand's 1."""
    condition, ones, dims = node.inputs[0].producer(), node.inputs[1], _dims(node.inputs[2])
    if condition is None or condition.op_type != "Equal" or dims is None:
        return None
    if condition.inputs[0] is not node.inputs[2] or _filled(condition.inputs[1]) != -1:
        return None
    if _filled(ones) != 1:
        return None
    return [1 if d == -1 else d for d in dims]


def _filled(value: ir.Value | None) -> int | None:
    """The one number every element of `value` holds, through ConstantOfShape and Mul."""
    array = get_numpy_value(value) if value is not None else None
    if array is not None:
        return int(array.reshape(-1)[0]) if array.size and np.all(array == array.flat[0]) else None
    node = value.producer() if value is not None else None
    if node is not None and node.op_type == "ConstantOfShape":
        attribute = node.attributes.get("value")
        return int(attribute.value.numpy().reshape(-1)[0]) if attribute is not None else 0
    if node is not None and node.op_type == "Mul":
        factors = [_filled(v) for v in node.inputs]
        return None if None in factors else factors[0] * factors[1]
    return None


def _expanded(node: ir.Node) -> ir.Shape | None:
    """Expand's output: the input broadcast against the target dims, right-aligned."""
    data, dims = node.inputs[0], _dims(node.inputs[1])
    if data is None or data.shape is None or dims is None:
        return None
    source = list(data.shape)
    rank = max(len(source), len(dims))
    source = [1] * (rank - len(source)) + source
    dims = [1] * (rank - len(dims)) + dims
    if any(isinstance(d, int) and d < 1 for d in dims):
        return None
    return ir.Shape([s if t == 1 else t for s, t in zip(source, dims, strict=True)])


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
        solved = _solve(list(data.shape), dims)
        if solved is None:
            return None
        dims[dims.index(-1)] = solved
    return ir.Shape(dims)


def _solve(source: list[Dim], dims: list[Dim]) -> Dim | None:
    """The dim a Reshape's one -1 stands for: a whole number when both sides hold the same
    named dims, or the one named dim of `source` that `dims` lacks when the numbers match
    (`Reshape(ids[batch, seq], [-1, seq])` keeps `batch`)."""
    symbolic_in = [str(d) for d in source if not isinstance(d, int)]
    symbolic_out = [str(d) for d in dims if not isinstance(d, int)]
    size_in = int(np.prod([d for d in source if isinstance(d, int)]))
    size_out = -int(np.prod([d for d in dims if isinstance(d, int)]))
    if size_out <= 0:
        return None
    if sorted(symbolic_in) == sorted(symbolic_out):
        return size_in // size_out if size_in % size_out == 0 else None
    missing = list(symbolic_in)
    for name in symbolic_out:
        if name not in missing:
            return None
        missing.remove(name)
    if len(missing) != 1 or size_in != size_out:
        return None
    return next(d for d in source if str(d) == missing[0])


# ONNX Runtime's fused ops whose outputs (these indices) have their first input's shape;
# ONNX inference does not know them, and every dim after a fused block would be lost.
_SAME_SHAPE_OUTPUTS = {"FastGelu": (0,), "Gelu": (0,), "BiasGelu": (0,),
                       "SkipLayerNormalization": (0, 3), "Attention": (0,)}  # fmt: skip


def _fused_shape(node: ir.Node) -> ir.Shape | None:
    data = node.inputs[0] if node.inputs else None
    if node.op_type not in _SAME_SHAPE_OUTPUTS or data is None or data.shape is None:
        return None
    if node.op_type == "Attention":  # self-attention keeps the width when Q|K|V are square
        weight = get_numpy_value(node.inputs[1])
        if weight is None or weight.shape != (data.shape[-1], 3 * data.shape[-1]):
            return None
    return data.shape


def _known_shape(node: ir.Node) -> ir.Shape | None:
    if node.domain == "com.microsoft":
        return _fused_shape(node)
    if node.op_type == "Expand" and len(node.inputs) == 2:
        return _expanded(node)
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
                    for index in _SAME_SHAPE_OUTPUTS.get(node.op_type, (0,)):
                        if index < len(node.outputs) and node.outputs[index] is not None:
                            node.outputs[index].shape = known[id(node)]
                            if node.outputs[index].dtype is None:  # fused ops: same type
                                node.outputs[index].dtype = node.inputs[0].dtype
            common.ShapeInferencePass()(model)
        return sum(before.get(value) != shape for value, shape in _shapes(model).items())


def _shapes(model: ir.Model) -> dict[ir.Value, str]:
    return {value: str(value.shape) for node in model.graph for value in node.outputs}
