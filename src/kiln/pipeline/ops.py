"""Array functions a pipeline's glue may call: each runs eagerly in numpy (the pipeline stays
plain Python) and each has an ONNX form (`onnx_nodes`) that gives the same result, so that
`kiln.compile_pipeline` can fold a chain of them into the adjacent model (fold.py).

    normalize(x, mean, std, scale)   (x·scale − mean) / std in float32, broadcast as numpy does
    to_layout(x, "HWC", "NCHW")      a transpose; letters of `dst` not in `src` are new axes of 1
    resize(x, (h, w), mode, layout)  float32; the convention below
    pad(x, pads, value)              constant padding, ((before, after), ...) per axis
    letterbox(x, (h, w), ...)        resize keeping the aspect ratio, then pad bottom and right
    softmax(x, axis), argmax(x, axis)
    ctc_greedy_decode(probs, blank)  argmax, repeats dropped, blanks dropped
    nms(boxes, scores, iou, score_threshold)

Resize convention (that of ONNX Resize as named): "linear" samples at half-pixel centres,
src = (dst + 0.5)·in/out − 0.5 clamped to the image (OpenCV's INTER_LINEAR, PIL's BILINEAR
without antialiasing); "nearest" takes src = floor(dst·in/out) (OpenCV's INTER_NEAREST).

Each result remembers, in a side table keyed by the result's identity and dropped with it, the
array its chain started from and the steps since: the results are plain numpy arrays, and an
array no op made costs nothing. `nms` takes two arrays, so it starts no chain and is never
folded.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np

from kiln.pipeline.ops_onnx import Step, chain_model, nms_model, onnx_nodes


class Pending(NamedTuple):
    """A folded model already computed what `steps` would make of this array (`value`);
    `recover` gives the array itself, should the glue do anything else with it."""

    steps: tuple[Step, ...]
    value: np.ndarray
    recover: Callable[[], np.ndarray]


class Trace(NamedTuple):
    """Where an op's result came from: the array its chain started from, and the steps."""

    root: np.ndarray
    steps: tuple[Step, ...] = ()
    sink: list[tuple[Step, ...]] | None = None  # a recording's: every chain built on a root
    pending: Pending | None = None


_TABLE: dict[int, tuple[weakref.ref, Trace]] = {}


def trace_of(array: Any) -> Trace | None:
    entry = _TABLE.get(id(array))
    return entry[1] if entry is not None and entry[0]() is array else None


def remember(array: np.ndarray, trace: Trace) -> np.ndarray:
    """Tag `array` with `trace` for as long as it lives."""
    key = id(array)
    drop = lambda _, key=key, table=_TABLE: table.pop(key, None)  # noqa: E731 (at exit too)
    _TABLE[key] = (weakref.ref(array, drop), trace)
    return array


def _apply(step: Step, x: Any) -> np.ndarray:
    trace = trace_of(x)
    if trace is not None and trace.pending is not None:
        return _resolve(step, x, trace)
    result = EAGER[step[0]](np.asarray(x), *step[1])
    if trace is None:
        trace = Trace(np.asarray(x))
    steps = (*trace.steps, step)
    if trace.sink is not None:
        trace.sink.append(steps)
    return remember(result, Trace(trace.root, steps, trace.sink))


def _resolve(step: Step, x: np.ndarray, trace: Trace) -> np.ndarray:
    """The next op on a folded model's output: the folded value where the op is the one the
    fold computed, else the real array recovered and the op run on it."""
    pending = trace.pending
    assert pending is not None
    if pending.steps[0] == step:
        if len(pending.steps) == 1:
            return pending.value
        rest = Pending(
            pending.steps[1:], pending.value, lambda: apply_steps(pending.recover(), (step,))
        )
        return remember(np.empty(0, pending.value.dtype), Trace(trace.root, pending=rest))
    return EAGER[step[0]](pending.recover(), *step[1])


def apply_steps(x: np.ndarray, steps: Sequence[Step]) -> np.ndarray:
    """The steps run eagerly on `x`, nothing remembered."""
    for name, args in steps:
        x = EAGER[name](np.asarray(x), *args)
    return x


# ---- the ops ----------------------------------------------------------------------------------


def _floats(values: Any) -> tuple[tuple[int, ...], tuple[float, ...]]:
    if isinstance(values, int | float):
        return (), (float(values),)
    array = np.asarray(values, np.float32)
    return tuple(array.shape), tuple(float(v) for v in array.ravel())


@lru_cache(maxsize=64)
def _array(values: tuple[tuple[int, ...], tuple[float, ...]]) -> np.ndarray:
    return np.asarray(values[1], np.float32).reshape(values[0])


def normalize(x: Any, mean: Any, std: Any, scale: float = 1.0) -> np.ndarray:
    """(x·scale − mean) / std in float32; `mean` and `std` broadcast against x as numpy does
    (per channel of an HWC image: three values each)."""
    return _apply(("normalize", (_floats(mean), _floats(std), float(scale))), x)


def _normalize(x: np.ndarray, mean: Any, std: Any, scale: float) -> np.ndarray:
    return (x.astype(np.float32) * np.float32(scale) - _array(mean)) / _array(std)


def to_layout(x: Any, src: str, dst: str) -> np.ndarray:
    """`x` (axes named by `src`, e.g. "HWC") with its axes as `dst` names them ("CHW", or
    "NCHW": letters not in `src` are new leading axes of size 1)."""
    if sorted(set(src)) != sorted(src) or not set(src) <= set(dst):
        raise ValueError(f"to_layout: cannot go from {src!r} to {dst!r}.")
    new = dst[: len(dst) - len(src)]
    if set(new) & set(src) or sorted(dst[len(new) :]) != sorted(src):
        raise ValueError(f"to_layout: {dst!r} must be new axes, then the letters of {src!r}.")
    perm = tuple(src.index(c) for c in dst[len(new) :])
    return _apply(("to_layout", (perm, len(new))), x)


def _to_layout(x: np.ndarray, perm: tuple[int, ...], new: int) -> np.ndarray:
    moved = np.ascontiguousarray(np.transpose(x, perm))
    return moved.reshape((1,) * new + moved.shape)


def resize(x: Any, size: tuple[int, int], mode: str = "linear", layout: str = "HWC") -> np.ndarray:
    """`x` resized to `size` (height, width) on the axes `layout` names H and W, as float32;
    the convention is the module's."""
    if mode not in ("linear", "nearest") or "H" not in layout or "W" not in layout:
        raise ValueError(f"resize: mode {mode!r}, layout {layout!r} (linear|nearest, with H, W).")
    axes = (layout.index("H"), layout.index("W"))
    return _apply(("resize", ((int(size[0]), int(size[1])), mode, axes, len(layout))), x)


def _source(n_in: int, n_out: int, mode: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per output index along one axis: the two source indices and the second one's weight."""
    scale = np.float32(n_out) / np.float32(n_in)
    dst = np.arange(n_out, dtype=np.float32)
    if mode == "nearest":
        i0 = np.minimum(np.floor(dst / scale).astype(np.int64), n_in - 1)
        return i0, i0, np.zeros(n_out, np.float32)
    src = np.clip((dst + np.float32(0.5)) / scale - np.float32(0.5), 0, n_in - 1)
    i0 = np.floor(src).astype(np.int64)
    return i0, np.minimum(i0 + 1, n_in - 1), (src - i0).astype(np.float32)


def _resize(x: np.ndarray, size: tuple[int, int], mode: str, axes: tuple[int, int],
            rank: int) -> np.ndarray:  # fmt: skip
    if x.ndim != rank:
        raise ValueError(f"resize: a {rank}-D array was named, got {x.ndim}-D.")
    out = x.astype(np.float32)
    for axis, n_out in zip(axes, size, strict=True):
        i0, i1, w = _source(out.shape[axis], n_out, mode)
        shape = [1] * out.ndim
        shape[axis] = n_out
        a, b = np.take(out, i0, axis=axis), np.take(out, i1, axis=axis)
        out = a + (b - a) * w.reshape(shape) if mode == "linear" else a
    return out


def pad(x: Any, pads: Sequence[tuple[int, int]], value: float = 0) -> np.ndarray:
    """`x` padded with `value`: `pads` gives (before, after) per axis."""
    return _apply(("pad", (tuple((int(a), int(b)) for a, b in pads), float(value))), x)


def _pad(x: np.ndarray, pads: tuple[tuple[int, int], ...], value: float) -> np.ndarray:
    return np.pad(x, pads, constant_values=np.asarray(value, x.dtype))


def letterbox(x: Any, size: tuple[int, int], value: float = 0, layout: str = "HWC") -> np.ndarray:
    """`x` resized (linear) to fit `size` (height, width) keeping its aspect ratio, then padded
    with `value` at the bottom and right: a resize and a pad, for this input's shape."""
    h_axis, w_axis = layout.index("H"), layout.index("W")
    h, w = np.shape(x)[h_axis], np.shape(x)[w_axis]
    ratio = min(size[0] / h, size[1] / w)
    fit = (max(1, min(size[0], round(h * ratio))), max(1, min(size[1], round(w * ratio))))
    pads = [(0, 0)] * len(layout)
    pads[h_axis], pads[w_axis] = (0, size[0] - fit[0]), (0, size[1] - fit[1])
    return pad(resize(x, fit, "linear", layout), pads, value)


def softmax(x: Any, axis: int = -1) -> np.ndarray:
    return _apply(("softmax", (int(axis),)), x)


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def argmax(x: Any, axis: int = -1) -> np.ndarray:
    """Indices (int64) of the largest value along `axis`, the first on ties; `axis` removed."""
    return _apply(("argmax", (int(axis),)), x)


def _argmax(x: np.ndarray, axis: int) -> np.ndarray:
    return np.argmax(x, axis=axis).astype(np.int64)


def ctc_greedy_decode(probs: Any, blank: int = 0) -> np.ndarray:
    """CTC's greedy path of probs [N, T, C] (or logits): the best class per step, repeats
    dropped, then blanks. Returns int64 [N, T]: each row's labels first, then -1."""
    return _apply(("ctc_greedy_decode", (int(blank),)), probs)


def _ctc(probs: np.ndarray, blank: int) -> np.ndarray:
    if probs.ndim != 3:
        raise ValueError(f"ctc_greedy_decode: probs must be [N, T, C], got {probs.shape}.")
    tokens = np.argmax(probs, axis=-1).astype(np.int64)
    previous = np.concatenate([np.full_like(tokens[:, :1], -1), tokens[:, :-1]], axis=1)
    keep = (tokens != blank) & (tokens != previous)
    out = np.full_like(tokens, -1)
    for row in range(tokens.shape[0]):
        kept = tokens[row][keep[row]]
        out[row, : kept.size] = kept
    return out


def nms(boxes: Any, scores: Any, iou: float = 0.5, score_threshold: float = 0.0) -> np.ndarray:
    """Non-maximum suppression over boxes [N, 4] (two opposite corners) and scores [N]: indices
    (int64) of the boxes kept, best score first. A box is kept when its score is above
    `score_threshold` and its IoU with every box kept before it is at most `iou`."""
    boxes, scores = np.asarray(boxes, np.float32), np.asarray(scores, np.float32)
    lo, hi = np.minimum(boxes[:, :2], boxes[:, 2:]), np.maximum(boxes[:, :2], boxes[:, 2:])
    area = np.prod(hi - lo, axis=1)
    kept: list[int] = []
    for i in np.argsort(-scores, kind="stable"):
        if not scores[i] > score_threshold:
            break
        inter = np.prod(np.clip(np.minimum(hi[i], hi[kept]) - np.maximum(lo[i], lo[kept]), 0,
                                None), axis=1)  # fmt: skip
        union = area[i] + area[kept] - inter
        with np.errstate(divide="ignore", invalid="ignore"):
            overlap = (inter > 0) & (area[i] > 0) & (area[kept] > 0) & (inter / union > iou)
        if not overlap.any():
            kept.append(int(i))
    return np.asarray(kept, np.int64)


EAGER: dict[str, Callable[..., np.ndarray]] = {
    "normalize": _normalize, "to_layout": _to_layout, "resize": _resize, "pad": _pad,
    "softmax": _softmax, "argmax": _argmax, "ctc_greedy_decode": _ctc,
}  # fmt: skip

__all__ = [
    "Pending", "Step", "Trace", "apply_steps", "argmax", "chain_model", "ctc_greedy_decode",
    "letterbox", "nms", "nms_model", "normalize", "onnx_nodes", "pad", "remember", "resize",
    "softmax", "to_layout", "trace_of",
]  # fmt: skip
