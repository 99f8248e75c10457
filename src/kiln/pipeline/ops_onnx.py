"""The ONNX form of each array function of ops.py: standard ONNX ops (opset 13 and later) that
give what the numpy form gives — bit for bit where the result is integer, to float32 rounding
where it is not (ONNX Runtime's kernels sum and interpolate in their own order)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import NodeProto, TensorProto, helper, numpy_helper

Step = tuple[str, tuple[Any, ...]]  # an op's name and its arguments, hashable
Built = tuple[list[NodeProto], list[TensorProto], np.dtype]
OPSET = 17
MIN_OPSET = 13  # Softmax's axis, Pad's and Unsqueeze's inputs as they are written here


class _Graph:
    """Nodes and constants of one step, their names under `prefix`."""

    def __init__(self, prefix: str):
        self.prefix, self.nodes, self.inits = prefix, [], []

    def name(self, what: str) -> str:
        return f"{self.prefix}{what}"

    def const(self, what: str, value: Any, dtype: Any = np.int64) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(value, dtype), self.name(what)))
        return self.name(what)

    def op(self, kind: str, inputs: list[str], output: str, **attrs: Any) -> str:
        self.nodes.append(helper.make_node(kind, inputs, [output], f"{output}:{kind}", **attrs))
        return output


def onnx_nodes(step: Step, x: str, y: str, dtype: np.dtype, prefix: str) -> Built:
    """The nodes that compute `step` from tensor `x` (of `dtype`) into tensor `y`, their
    constants, and the dtype of `y`."""
    g = _Graph(prefix)
    name, args = step
    out = BUILDERS[name](g, x, y, np.dtype(dtype), *args)
    return g.nodes, g.inits, np.dtype(out)


def _float(g: _Graph, x: str, dtype: np.dtype) -> str:
    if dtype == np.float32:
        return x
    return g.op("Cast", [x], g.name("float"), to=TensorProto.FLOAT)


def _normalize(g: _Graph, x: str, y: str, dtype: np.dtype, mean, std, scale) -> Any:
    scaled = g.op("Mul", [_float(g, x, dtype), g.const("scale", scale, np.float32)], g.name("x"))
    mean_ = g.const("mean", np.reshape(mean[1], mean[0]), np.float32)
    centred = g.op("Sub", [scaled, mean_], g.name("centred"))
    g.op("Div", [centred, g.const("std", np.reshape(std[1], std[0]), np.float32)], y)
    return np.float32


def _to_layout(g: _Graph, x: str, y: str, dtype: np.dtype, perm, new) -> Any:
    if not new:
        g.op("Transpose", [x], y, perm=list(perm))
        return dtype
    moved = g.op("Transpose", [x], g.name("moved"), perm=list(perm))
    g.op("Unsqueeze", [moved, g.const("axes", list(range(new)))], y)
    return dtype


def _resize(g: _Graph, x: str, y: str, dtype: np.dtype, size, mode, axes, rank) -> Any:
    keep, fixed = np.ones(rank, np.int64), np.zeros(rank, np.int64)
    for axis, n in zip(axes, size, strict=True):
        keep[axis], fixed[axis] = 0, n
    shape = g.op("Shape", [x], g.name("shape"))
    kept = g.op("Mul", [shape, g.const("keep", keep)], g.name("kept"))
    sizes = g.op("Add", [kept, g.const("fixed", fixed)], g.name("sizes"))
    transform = "half_pixel" if mode == "linear" else "asymmetric"
    g.op("Resize", [_float(g, x, dtype), "", "", sizes], y, mode=mode,
         coordinate_transformation_mode=transform, nearest_mode="floor")  # fmt: skip
    return np.float32


def _pad(g: _Graph, x: str, y: str, dtype: np.dtype, pads, value) -> Any:
    begins, ends = [p[0] for p in pads], [p[1] for p in pads]
    g.op("Pad", [x, g.const("pads", begins + ends), g.const("value", value, dtype)], y)
    return dtype


def _softmax(g: _Graph, x: str, y: str, dtype: np.dtype, axis) -> Any:
    g.op("Softmax", [x], y, axis=axis)
    return dtype


def _argmax(g: _Graph, x: str, y: str, dtype: np.dtype, axis) -> Any:
    g.op("ArgMax", [x], y, axis=axis, keepdims=0)
    return np.int64


def _ctc(g: _Graph, x: str, y: str, dtype: np.dtype, blank) -> Any:
    """Labels kept (not blank, not the previous step's) moved first by a stable sort on
    their step (TopK over step, or step + T for a dropped one), the rest set to -1."""
    tokens = g.op("ArgMax", [x], g.name("tokens"), axis=-1, keepdims=0)
    first = g.op("Slice", [tokens, g.const("0", [0]), g.const("1", [1]), g.const("ax", [1])],
                 g.name("first"))  # fmt: skip
    none = g.op("Sub", [g.op("Mul", [first, g.const("zero", 0)], g.name("zeros")),
                        g.const("one", 1)], g.name("none"))  # fmt: skip
    head = g.op("Slice", [tokens, g.const("start", [0]), g.const("stop", [-1]),
                          g.name("ax")], g.name("head"))  # fmt: skip
    previous = g.op("Concat", [none, head], g.name("previous"), axis=1)
    repeat = g.op("Equal", [tokens, previous], g.name("repeat"))
    is_blank = g.op("Equal", [tokens, g.const("blank", blank)], g.name("is_blank"))
    drop = g.op("Or", [repeat, is_blank], g.name("drop"))
    steps = g.op("Gather", [g.op("Shape", [tokens], g.name("shape")), g.const("i1", [1])],
                 g.name("steps"))  # fmt: skip
    steps_f = g.op("Cast", [steps], g.name("steps_f"), to=TensorProto.FLOAT)
    where = g.op("Range", [g.const("f0", 0.0, np.float32), g.op("Squeeze", [steps_f],
                 g.name("t")), g.const("f1", 1.0, np.float32)], g.name("where"))  # fmt: skip
    key = g.op("Where", [drop, g.op("Add", [where, steps_f], g.name("late")), where],
               g.name("key"))  # fmt: skip
    g.nodes.append(helper.make_node("TopK", [key, steps], [g.name("sorted"), g.name("order")],
                                    g.name("TopK"), axis=1, largest=0, sorted=1))  # fmt: skip
    labels = g.op("GatherElements", [tokens, g.name("order")], g.name("labels"), axis=1)
    kept = g.op("Less", [g.name("sorted"), steps_f], g.name("kept"))
    g.op("Where", [kept, labels, g.const("minus", -1)], y)
    return np.int64


BUILDERS = {
    "normalize": _normalize, "to_layout": _to_layout, "resize": _resize, "pad": _pad,
    "softmax": _softmax, "argmax": _argmax, "ctc_greedy_decode": _ctc,
}  # fmt: skip


def elem_type(dtype: Any) -> int:
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def chain_nodes(steps: Sequence[Step], x: str, y: str, dtype: Any, prefix: str) -> Built:
    """The nodes of every step in turn, from `x` to `y`."""
    nodes: list[NodeProto] = []
    inits: list[TensorProto] = []
    current, dtype = x, np.dtype(dtype)
    for i, step in enumerate(steps):
        out = y if i == len(steps) - 1 else f"{prefix}{i}/out"
        built, consts, dtype = onnx_nodes(step, current, out, dtype, f"{prefix}{i}/")
        nodes, inits, current = nodes + built, inits + consts, out
    return nodes, inits, dtype


def chain_model(steps: Sequence[Step], dtype: Any, rank: int) -> onnx.ModelProto:
    """A model of the steps alone: input "x" (`dtype`, `rank` dims of any size), output "y"."""
    nodes, inits, out = chain_nodes(steps, "x", "y", dtype, "chain/")
    graph = helper.make_graph(
        nodes, "chain",
        [helper.make_tensor_value_info("x", elem_type(dtype), [f"d{i}" for i in range(rank)])],
        [helper.make_tensor_value_info("y", elem_type(out), None)], inits,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])


def nms_model(iou: float, score_threshold: float) -> onnx.ModelProto:
    """ops.nms as a model: inputs boxes [N, 4] and scores [N], output the kept indices [K]."""
    g = _Graph("nms/")
    boxes = g.op("Unsqueeze", ["boxes", g.const("a0", [0])], g.name("boxes"))
    scores = g.op("Unsqueeze", ["scores", g.const("a01", [0, 1])], g.name("scores"))
    consts = [g.const("max", [1 << 30]), g.const("iou", [iou], np.float32),
              g.const("thr", [score_threshold], np.float32)]  # fmt: skip
    picked = g.op("NonMaxSuppression", [boxes, scores, *consts], g.name("picked"))
    g.op("Gather", [picked, g.const("col", 2)], "indices", axis=1)
    graph = helper.make_graph(
        g.nodes, "nms",
        [helper.make_tensor_value_info("boxes", TensorProto.FLOAT, ["n", 4]),
         helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("indices", TensorProto.INT64, ["k"])], g.inits,
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
