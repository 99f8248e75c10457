"""Find the Q, K and V projections behind an attention block, whatever layout ops an exporter
put between them and the scores (head reshapes, transposes, K's transpose written as
Reshape → Transpose → Reshape, scales split between Q and K).

The walk only finds the weights; it does not prove the layout. `attention_probe` runs the
block to prove that, so the walk can stay permissive.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from kiln.ir.onnxscript_internals import get_numpy_value

LAYOUT = {"Transpose", "Reshape", "Squeeze", "Unsqueeze", "Identity"}


class NotAttention(Exception):
    """Why a block is not an attention the rule can fuse; the message is the check that
    failed, for the rule's MatchResult and `optimize`'s notes."""


@dataclass
class Projection:
    x: ir.Value  # the activations it reads, [batch, seq, in]
    weight: np.ndarray  # [in, out]
    bias: np.ndarray  # [out]


def _op(value: ir.Value | None) -> ir.Node | None:
    node = value.producer() if value is not None else None
    return node if node is not None and node.domain in ("", "ai.onnx") else None


def scalar(value: ir.Value | None) -> float | None:
    array = get_numpy_value(value) if value is not None else None
    return float(array.reshape(())) if array is not None and array.size == 1 else None


def strip_scale(value: ir.Value) -> tuple[ir.Value, float]:
    """(v, f) with value = v · f, through Mul/Div by scalar constants."""
    factor = 1.0
    while (node := _op(value)) is not None and node.op_type in ("Mul", "Div"):
        constants = [scalar(v) for v in node.inputs]
        if node.op_type == "Div" and constants[1] is not None and constants[1] != 0:
            value, factor = node.inputs[0], factor / constants[1]
        elif node.op_type == "Mul" and constants[1] is not None:
            value, factor = node.inputs[0], factor * constants[1]
        elif node.op_type == "Mul" and constants[0] is not None:
            value, factor = node.inputs[1], factor * constants[0]
        else:
            break
    return value, factor


def source(value: ir.Value) -> tuple[ir.Value, float]:
    """The value before every layout op and scalar scale, and the product of the scales."""
    factor = 1.0
    while True:
        value, scale = strip_scale(value)
        factor *= scale
        node = _op(value)
        if node is None or node.op_type not in LAYOUT:
            return value, factor
        value = node.inputs[0]


def projection(value: ir.Value) -> Projection:
    """The Linear that makes `value`: MatMul(x, W) with an optional constant bias Add, or
    Gemm on x flattened by a Reshape."""
    node = _op(value)
    bias = None
    if node is not None and node.op_type == "Add":
        constants = [get_numpy_value(v) for v in node.inputs]
        index = 1 if constants[1] is not None else 0
        bias, node = constants[index], _op(node.inputs[1 - index])
    if node is not None and node.op_type == "MatMul":
        x, weight = node.inputs[0], get_numpy_value(node.inputs[1])
    elif node is not None and node.op_type == "Gemm" and bias is None:
        x, weight = _gemm(node)
        bias = get_numpy_value(node.inputs[2]) if len(node.inputs) > 2 else None
    else:
        raise NotAttention(f"{value.name} is not made by a MatMul or Gemm projection")
    if weight is None or weight.ndim != 2:
        raise NotAttention(f"the projection making {value.name} has no constant weight matrix")
    out = weight.shape[1]
    if bias is None:
        bias = np.zeros(out, weight.dtype)
    if bias.size != out:
        raise NotAttention(f"the projection making {value.name} has a bias of another shape")
    return Projection(x, weight, bias.reshape(out))


def _gemm(node: ir.Node) -> tuple[ir.Value, np.ndarray | None]:
    attributes = node.attributes
    if attributes.get_int("transA", 0) or attributes.get_float("alpha", 1.0) != 1.0:
        raise NotAttention(f"Gemm {node.name} transposes or scales its input")
    if len(node.inputs) > 2 and attributes.get_float("beta", 1.0) != 1.0:
        raise NotAttention(f"Gemm {node.name} scales its bias")
    weight = get_numpy_value(node.inputs[1])
    if weight is not None and attributes.get_int("transB", 0):
        weight = weight.T
    x = node.inputs[0]
    flatten = _op(x)
    if flatten is not None and flatten.op_type == "Reshape":
        x = flatten.inputs[0]
    return x, weight


def heads_projection(value: ir.Value) -> tuple[Projection, float]:
    """The projection (its columns for this head group) behind Q, K or V, and the scale
    applied on the way. A packed QKV projection split in three gives its share."""
    start, factor = source(value)
    split = _op(start)
    if split is None or split.op_type != "Split":
        return projection(start), factor
    whole = projection(split.inputs[0])
    index, parts = list(split.outputs).index(start), len(split.outputs)
    sizes = get_numpy_value(split.inputs[1]) if len(split.inputs) > 1 else None
    axis = split.attributes.get_int("axis", 0)
    width = whole.weight.shape[1]
    if (
        axis not in (-1, 2)
        or width % parts
        or (sizes is not None and sizes.tolist() != [width // parts] * parts)
    ):
        raise NotAttention(f"Split {split.name} is not {parts} equal parts of the last axis")
    columns = slice(index * width // parts, (index + 1) * width // parts)
    return Projection(whole.x, whole.weight[:, columns], whole.bias[columns]), factor


def scores_parts(scores: ir.Value) -> tuple[ir.Value, ir.Value, ir.Value | None, float]:
    """(q, k, bias or None, scale) with scores = scale·(q @ k) + bias."""
    value, factor = strip_scale(scores)
    bias = None
    node = _op(value)
    if node is not None and node.op_type == "Add":
        products = [i for i, v in enumerate(node.inputs) if _is_product(v)]
        if not products:
            raise NotAttention("the scores are not a MatMul of Q and K plus a mask")
        value, bias = node.inputs[products[0]], node.inputs[1 - products[0]]
        value, more = strip_scale(value)
        factor *= more
    node = _op(value)
    if node is None or node.op_type != "MatMul":
        raise NotAttention("the scores are not a MatMul of Q and K")
    return node.inputs[0], node.inputs[1], bias, factor


def _is_product(value: ir.Value | None) -> bool:
    node = _op(strip_scale(value)[0]) if value is not None else None
    return node is not None and node.op_type == "MatMul"
