"""What crosses the link between `kiln split`'s edge and server parts, encoded inside the graphs.

The edge graph ends with the encoding ops and the server graph begins with the decoding ops,
so each part is an ordinary model: `kiln serve server.kiln` needs nothing special and the
compiler's verification covers the codec like any other node.

- `none`: the tensor as it is (fp32).
- `fp16`: a Cast to float16 and back.
- `int8`: per-channel symmetric int8; each sample's per-channel scale (max |x| / 127) is
  computed in the graph and sent as a second fp32 tensor.
- `topk`: the k = fraction·N largest-magnitude values of each sample (fp16) and their
  positions (int32); the server scatters them into zeros.

Only fp32 boundaries are encoded; others (token ids, masks) cross as they are.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
from onnx_ir import tape

from kiln.errors import KilnError

CODECS = ("none", "fp16", "int8", "topk")
TOPK_FRACTIONS = (0.1, 0.05)  # what `--codec auto` tries; an explicit `topk` uses the first
_EPS = 1e-12  # an all-zero channel still gets a finite scale
_NODE_PREFIX = "kiln.split"


@dataclass(frozen=True)
class Codec:
    """One encoding of the boundary: a name of CODECS, and for topk the kept fraction."""

    name: str
    fraction: float | None = None

    @property
    def label(self) -> str:
        return f"topk:{self.fraction:g}" if self.name == "topk" else self.name

    @property
    def lossless(self) -> bool:
        return self.name == "none"

    def wire_bytes(self, shape: tuple[int, ...], dtype: np.dtype) -> int:
        """Bytes on the wire for one boundary tensor of this shape and element type."""
        count = math.prod(shape)
        if not applies(self, dtype, shape):
            return count * np.dtype(dtype).itemsize
        if self.name == "fp16":
            return count * 2
        if self.name == "int8":
            return count + 4 * math.prod(_scale_shape(shape))
        if self.name == "topk":
            batch = shape[0] if shape else 1
            return batch * _keep(self.fraction or 0.0, _per_sample(shape)) * (2 + 4)
        return count * 4

    def to_json(self) -> dict:
        return {"name": self.name, "fraction": self.fraction, "label": self.label}


def parse_codec(text: str) -> Codec | None:
    """`none|fp16|int8|topk|topk:0.05` → a Codec; "auto" → None (the caller chooses)."""
    name, _, value = text.partition(":")
    if name == "auto" and not value:
        return None
    if name not in CODECS or (value and name != "topk"):
        raise KilnError(
            f"--codec {text}: use auto, none, fp16, int8, topk or topk:FRACTION (e.g. topk:0.05)."
        )
    if name != "topk":
        return Codec(name)
    try:
        fraction = float(value) if value else TOPK_FRACTIONS[0]
    except ValueError:
        fraction = -1.0
    if not 0 < fraction < 1:
        raise KilnError(f"--codec {text}: the topk fraction must be in (0, 1), e.g. topk:0.05.")
    return Codec("topk", fraction)


def auto_codecs() -> list[Codec]:
    """What `--codec auto` considers, each kept only if the outputs stay within the budget."""
    return [Codec("none"), Codec("fp16"), Codec("int8")] + [
        Codec("topk", f) for f in TOPK_FRACTIONS
    ]


def applies(codec: Codec, dtype: np.dtype, shape: tuple[int, ...]) -> bool:
    """Whether `codec` encodes a tensor of this type (fp32 only; topk needs a sample axis)."""
    if codec.name == "none" or np.dtype(dtype) != np.float32:
        return False
    return codec.name != "topk" or len(shape) >= 2


def wire_names(
    codec: Codec, tensor: str, dtype: np.dtype, shape: tuple[int, ...], model_input: bool = False
) -> list[str]:
    """The names of the tensors that carry `tensor` over the link (`model_input`: the whole
    model's input, sent by an Identity under a name of its own)."""
    if not applies(codec, dtype, shape):
        return [f"{tensor}.raw" if model_input else tensor]
    return {
        "fp16": [f"{tensor}.fp16"],
        "int8": [f"{tensor}.int8", f"{tensor}.scale"],
        "topk": [f"{tensor}.values", f"{tensor}.indices"],
    }[codec.name]


def encode(piece: ir.Model, tensor: str, codec: Codec, shape: tuple[int, ...]) -> None:
    """Make the edge piece's output `tensor` leave encoded: its outputs become the wire
    tensors. `shape` is the tensor's concrete shape on the reference inputs (its non-batch
    dims must not change between requests for topk)."""
    graph = piece.graph
    value = next(v for v in graph.outputs if v.name == tensor)
    dtype = value.dtype.numpy() if value.dtype is not None else np.dtype(np.float32)
    index = list(graph.outputs).index(value)
    if not applies(codec, dtype, shape):
        if value.producer() is None:  # a graph input sent as it is: a node must produce it
            sent = _tape(graph).op("Identity", [value], name=_n(tensor, "send"))
            sent.name = wire_names(codec, tensor, dtype, shape, model_input=True)[0]
            sent.type, sent.shape = value.type, value.shape
            graph.outputs[index] = sent
        return
    t = _tape(graph)
    names = wire_names(codec, tensor, dtype, shape)
    wires = {
        "fp16": lambda: [_cast(t, value, ir.DataType.FLOAT16, tensor)],
        "int8": lambda: _int8_encode(t, value, shape, tensor, _opset(piece)),
        "topk": lambda: _topk_encode(t, value, shape, tensor, codec.fraction or 0.0),
    }[codec.name]()
    dims = list(value.shape) if value.shape is not None else list(shape)
    types, shapes = _wire_types(codec), _wire_shapes(codec, dims, shape)
    for wire, name, kind, dims_ in zip(wires, names, types, shapes, strict=True):
        wire.name, wire.type, wire.shape = name, ir.TensorType(kind), ir.Shape(dims_)
    graph.outputs.pop(index)
    for offset, wire in enumerate(wires):
        graph.outputs.insert(index + offset, wire)


def decode(
    piece: ir.Model, tensor: str, codec: Codec, dtype: np.dtype, shape: tuple, model_input: bool
) -> None:
    """Make the server piece take the wire tensors for its input `tensor` and decode them."""
    graph = piece.graph
    value = next(v for v in graph.inputs if v.name == tensor)
    if not applies(codec, dtype, shape):
        value.name = wire_names(codec, tensor, dtype, shape, model_input)[0]
        return
    names = wire_names(codec, tensor, dtype, shape)
    dims = list(value.shape) if value.shape is not None else list(shape)
    shapes = _wire_shapes(codec, dims, shape)
    wires = [
        ir.Value(name=n, type=ir.TensorType(d), shape=ir.Shape(s))
        for n, d, s in zip(names, _wire_types(codec), shapes, strict=True)
    ]
    t = _tape(graph)
    if codec.name == "fp16":
        decoded = t.op("Cast", [wires[0]], {"to": ir.DataType.FLOAT}, name=_n(tensor, "to_fp32"))
    elif codec.name == "int8":
        decoded = _int8_decode(t, wires, tensor)
    else:
        decoded = _topk_decode(t, wires, shape, tensor)
    index = list(graph.inputs).index(value)
    ir.convenience.replace_all_uses_with(value, decoded)
    graph.inputs.pop(index)
    for offset, wire in enumerate(wires):
        graph.inputs.insert(index + offset, wire)
    decoded.name, decoded.shape, decoded.type = tensor, value.shape, value.type
    graph.sort()


def _tape(graph: ir.Graph) -> tape.Tape:
    return tape.Tape(graph)


def _n(tensor: str, step: str) -> str:
    return f"{_NODE_PREFIX}.{tensor}.{step}"


def _opset(piece: ir.Model) -> int:
    return piece.graph.opset_imports.get("", piece.opset_imports.get("", 17))


def _const(t: tape.Tape, array: np.ndarray, name: str) -> ir.Value:
    return t.op("Constant", [], {"value": ir.tensor(array)}, name=name)


def _cast(t: tape.Tape, value: ir.Value, to: ir.DataType, tensor: str) -> ir.Value:
    return t.op("Cast", [value], {"to": to}, name=_n(tensor, f"to_{to.name.lower()}"))


def _scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Per sample and channel: axis 0 is the sample; the channel is axis 1 of conv features
    (rank ≥ 4), the last axis of a sequence [B, S, D]; rank ≤ 2 gets one scale per sample."""
    axes = set(_reduced_axes(len(shape)))
    return tuple(1 if i in axes else d for i, d in enumerate(shape))


def _reduced_axes(rank: int) -> list[int]:
    if rank <= 1:
        return list(range(rank))
    if rank <= 3:  # [B, D]: per sample; [B, S, D]: per sample and feature
        return [1]
    return list(range(2, rank))


def _reduce_max(t: tape.Tape, x: ir.Value, axes: list[int], opset: int, tensor: str) -> ir.Value:
    name = _n(tensor, "absmax")
    if not axes:
        return x
    if opset >= 18:  # axes became an input
        return t.op("ReduceMax", [x, _const(t, np.array(axes, np.int64), _n(tensor, "axes"))],
                    {"keepdims": 1}, name=name)  # fmt: skip
    return t.op("ReduceMax", [x], {"axes": axes, "keepdims": 1}, name=name)


def _int8_encode(
    t: tape.Tape, x: ir.Value, shape: tuple[int, ...], tensor: str, opset: int
) -> list[ir.Value]:
    absx = t.op("Abs", [x], name=_n(tensor, "abs"))
    peak = _reduce_max(t, absx, _reduced_axes(len(shape)), opset, tensor)
    floor = _const(t, np.array(_EPS, np.float32), _n(tensor, "eps"))
    scale = t.op("Div", [t.op("Max", [peak, floor], name=_n(tensor, "floor")),
                         _const(t, np.array(127.0, np.float32), _n(tensor, "levels"))],
                 name=_n(tensor, "scale"))  # fmt: skip
    steps = t.op(
        "Round", [t.op("Div", [x, scale], name=_n(tensor, "div"))], name=_n(tensor, "round")
    )
    low = _const(t, np.array(-127.0, np.float32), _n(tensor, "low"))
    high = _const(t, np.array(127.0, np.float32), _n(tensor, "high"))
    clipped = t.op("Clip", [steps, low, high], name=_n(tensor, "clip"))
    return [_cast(t, clipped, ir.DataType.INT8, tensor), scale]


def _int8_decode(t: tape.Tape, wires: list[ir.Value], tensor: str) -> ir.Value:
    values = _cast(t, wires[0], ir.DataType.FLOAT, tensor)
    return t.op("Mul", [values, wires[1]], name=_n(tensor, "dequantize"))


def _per_sample(shape: tuple[int, ...]) -> int:
    return math.prod(shape[1:])


def _keep(fraction: float, count: int) -> int:
    return max(1, min(count, round(fraction * count)))


def _topk_encode(
    t: tape.Tape, x: ir.Value, shape: tuple[int, ...], tensor: str, fraction: float
) -> list[ir.Value]:
    count = _per_sample(shape)
    flat_shape = _const(t, np.array([-1, count], np.int64), _n(tensor, "flat_shape"))
    flat = t.op("Reshape", [x, flat_shape], name=_n(tensor, "flatten"))
    magnitude = t.op("Abs", [flat], name=_n(tensor, "abs"))
    k = _const(t, np.array([_keep(fraction, count)], np.int64), _n(tensor, "k"))
    _, where = t.op_multi_out(
        "TopK", [magnitude, k], {"axis": -1, "largest": 1, "sorted": 0},
        num_outputs=2, name=_n(tensor, "topk"),
    )  # fmt: skip
    kept = t.op("GatherElements", [flat, where], {"axis": 1}, name=_n(tensor, "gather"))
    return [_cast(t, kept, ir.DataType.FLOAT16, tensor), _cast(t, where, ir.DataType.INT32, tensor)]


def _topk_decode(t: tape.Tape, wires: list[ir.Value], shape: tuple, tensor: str) -> ir.Value:
    values = _cast(t, wires[0], ir.DataType.FLOAT, tensor)
    indices = _cast(t, wires[1], ir.DataType.INT64, tensor)
    batch = t.op("Gather", [t.op("Shape", [values], name=_n(tensor, "shape")),
                            _const(t, np.array([0], np.int64), _n(tensor, "axis0"))],
                 {"axis": 0}, name=_n(tensor, "batch"))  # fmt: skip
    count = _const(t, np.array([_per_sample(shape)], np.int64), _n(tensor, "count"))
    flat_shape = t.op("Concat", [batch, count], {"axis": 0}, name=_n(tensor, "flat_shape"))
    zeros = t.op("ConstantOfShape", [flat_shape], {"value": ir.tensor(np.zeros(1, np.float32))},
                 name=_n(tensor, "zeros"))  # fmt: skip
    flat = t.op(
        "ScatterElements", [zeros, indices, values], {"axis": 1}, name=_n(tensor, "scatter")
    )
    rest = _const(t, np.array(shape[1:], np.int64), _n(tensor, "rest"))
    full = t.op("Concat", [batch, rest], {"axis": 0}, name=_n(tensor, "full_shape"))
    return t.op("Reshape", [flat, full], name=_n(tensor, "unflatten"))


def _wire_types(codec: Codec) -> list[ir.DataType]:
    return {
        "fp16": [ir.DataType.FLOAT16],
        "int8": [ir.DataType.INT8, ir.DataType.FLOAT],
        "topk": [ir.DataType.FLOAT16, ir.DataType.INT32],
    }[codec.name]


def _wire_shapes(codec: Codec, dims: list, shape: tuple[int, ...]) -> list[list]:
    """The wire tensors' shapes, the batch dim kept symbolic where the boundary's is."""
    batch = dims[0] if dims else 1
    if codec.name == "fp16":
        return [dims]
    if codec.name == "int8":
        axes = set(_reduced_axes(len(dims)))
        return [dims, [1 if i in axes else d for i, d in enumerate(dims)]]
    k = _keep(codec.fraction or 0.0, _per_sample(shape))
    return [[batch, k], [batch, k]]
