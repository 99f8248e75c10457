"""Padding inputs up to a bucket, slicing outputs back, and the check that makes it safe.

Padding a dim is allowed only after Kiln saw, on sample inputs, that it leaves the unpadded part
of every output unchanged:
- a batch dim (axis 0 of every input that has it): padded rows must not affect the real ones
  (rows independent). The check fills the padding with *other random rows*, not copies, so
  that a model mixing rows (a reduction over the batch) is caught; the same property makes
  concatenating requests in `run_batch` safe.
- any other dim (a sequence): only with an attention-mask input over that dim, which Kiln sets
  to 0 on the padding; the check fills the padded positions of the other inputs with random
  values, so that a position the mask does not hide is caught.
Where the check fails, the dim runs unpadded (exact bucket sizes, else the dynamic executable).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from kiln.errors import KilnError
from kiln.ir.inputs import default_dims, is_mask_input, synthesize

# Per input: each axis' static size, symbolic dim name, or None (unnamed dynamic).
Layout = dict[str, list[int | str | None]]
# Dim names exporters write for "unknown", not for a size shared between axes (paddle2onnx
# writes "?" on every free axis: PP-OCR's classifier has height and width both "?").
ANONYMOUS_DIMS = frozenset({"?"})
RunFn = Callable[[dict[str, np.ndarray]], list[np.ndarray]]


def input_layout(model: ir.Model) -> Layout:
    layout: Layout = {}
    for value in model.graph.inputs:
        if value.name in model.graph.initializers:
            continue
        dims: list[int | str | None] = []
        for dim in value.shape or []:
            if isinstance(dim, int):
                dims.append(dim if dim >= 0 else None)
            else:
                named = dim.value and str(dim.value) not in ANONYMOUS_DIMS
                dims.append(str(dim.value) if named else None)
        layout[value.name] = dims
    return layout


def symbolic_dims(layout: Layout) -> list[str]:
    return sorted({d for dims in layout.values() for d in dims if isinstance(d, str)})


def batch_dims(layout: Layout) -> set[str]:
    """Dims found only at axis 0: a batch, whose rows are the model's independent items."""
    other = {d for dims in layout.values() for d in dims[1:] if isinstance(d, str)}
    return {dims[0] for dims in layout.values() if dims and isinstance(dims[0], str)} - other


def mask_inputs(layout: Layout) -> list[str]:
    """Attention masks (attention_mask, input_mask, ...), by Kiln's one rule for them."""
    return [name for name in layout if is_mask_input(name)]


def dims_of(feeds: Mapping[str, np.ndarray], layout: Layout) -> dict[str, int]:
    """The value of every symbolic dim in these feeds; inconsistent values are the user's error."""
    values: dict[str, tuple[int, str]] = {}
    for name, dims in layout.items():
        shape = np.shape(feeds[name])
        for axis, dim in enumerate(dims):
            if not isinstance(dim, str):
                continue
            if dim in values and values[dim][0] != shape[axis]:
                first, where = values[dim]
                raise KilnError(
                    f"input '{name}' has {dim}={shape[axis]} (shape {list(shape)}) but input "
                    f"'{where}' has {dim}={first}; inputs sharing a dim must agree."
                )
            values.setdefault(dim, (shape[axis], name))
    return {dim: value for dim, (value, _) in values.items()}


def pad_feeds(
    feeds: Mapping[str, np.ndarray], layout: Layout, target: Mapping[str, int], batch: set[str]
) -> dict[str, np.ndarray]:
    """Pad each symbolic dim up to `target`. Batch dims (axis 0) repeat the last row (a valid
    input, so the padded rows compute nothing odd such as NaN from an all-zero mask); other
    dims get 0: mask 0 (= padding), token id 0, zeros. One allocation and copy per input
    (np.pad took a third of a small model's request time)."""
    out = {}
    for name, array in feeds.items():
        array = np.asarray(array)
        shape = [
            max(size, target.get(dim, 0)) if isinstance(dim, str) else size
            for size, dim in zip(array.shape, layout[name], strict=True)
        ]
        if list(array.shape) == shape:
            out[name] = array
            continue
        padded = np.zeros(shape, array.dtype)
        padded[tuple(slice(0, n) for n in array.shape)] = array
        rows = array.shape[0] if array.ndim else 0
        if rows and layout[name][0] in batch and shape[0] > rows:
            padded[rows:] = padded[rows - 1]
        out[name] = padded
    return out


def slice_outputs(
    outputs: list[np.ndarray],
    names: list[str],
    axes: Mapping[str, Mapping[str, list[int]]],
    sizes: Mapping[str, int],
) -> list[np.ndarray]:
    """Cut every output back to `sizes` along the axes each dim maps to (learnt by the check)."""
    result = []
    for name, array in zip(names, outputs, strict=True):
        index = [slice(None)] * array.ndim
        for dim, size in sizes.items():
            for axis in axes.get(dim, {}).get(name, []):
                index[axis] = slice(0, size)
        result.append(array[tuple(index)])
    return result


@dataclass
class Verdict:
    """Whether padding one dim is safe, why, and which output axes follow that dim."""

    dim: str
    allowed: bool
    reason: str
    axes: dict[str, list[int]] = field(default_factory=dict)  # output name -> axes


def check_padding(
    model: ir.Model,
    layout: Layout,
    dim: str,
    run: RunFn,
    output_names: list[str],
    precision: str = "fp32",
) -> Verdict:
    """Run the model unpadded and padded (with adversarial filler) and compare the unpadded
    part of every output, within the tolerance of `precision` (see `close`); see the module
    docstring."""
    is_batch = dim in batch_dims(layout)
    masks = [m for m in mask_inputs(layout) if dim in layout[m]]
    if not is_batch and not masks:
        return Verdict(dim, False, f"no attention-mask input covers '{dim}'")
    if is_batch:
        small, big = 2, 3
    else:
        # A size the model surely accepts (its default), kept small so the check is cheap.
        big = max(2, min(int(default_dims(model).get(dim, 16)), 16))
        small = big - max(1, big // 4)
    base = synthesize(model, dims={dim: small}, seed=0)
    filler = synthesize(model, dims={dim: big}, seed=2)
    padded = {}
    for name, array in base.items():
        extra = filler[name]
        for axis, d in enumerate(layout[name]):
            if d == dim:
                tail = np.take(extra, range(small, big), axis=axis)
                if name in masks and not is_batch:
                    tail = np.zeros_like(tail)
                array = np.concatenate([array, tail], axis=axis)
                break
        padded[name] = array
    try:
        ref, got = run(base), run(padded)
    except KilnError as exc:
        return Verdict(dim, False, f"the check run failed: {exc}")
    axes: dict[str, list[int]] = {}
    for name, r, g in zip(output_names, ref, got, strict=True):
        moved = [a for a in range(r.ndim) if r.shape[a] != g.shape[a]] if r.ndim == g.ndim else None
        if moved is None or any((r.shape[a], g.shape[a]) != (small, big) for a in moved):
            return Verdict(dim, False, f"output '{name}' does not scale with '{dim}'")
        axes[name] = moved
        g = g[tuple(slice(0, small) if a in moved else slice(None) for a in range(g.ndim))]
        if not close(r, g, precision):
            what = "rows are not independent" if is_batch else "the mask does not hide padding"
            return Verdict(dim, False, f"padding '{dim}' changes output '{name}' ({what})")
    how = "rows independent" if is_batch else f"masked by {masks[0]}"
    return Verdict(dim, True, how, axes)


def close(reference: np.ndarray, got: np.ndarray, precision: str = "fp32") -> bool:
    """Equal within fp32 rounding; below fp32, within that precision's own noise: dynamic int8
    quantises with one scale over the whole tensor, so other rows move a row's result a little
    (BERT-tiny int8: cosine 0.99999, 5e-4 of the scale), while mixing rows moves it a lot."""
    if reference.shape != got.shape:
        return False
    if not np.issubdtype(reference.dtype, np.floating):
        return np.array_equal(reference, got)
    scale = max(1.0, float(np.max(np.abs(reference)))) if reference.size else 1.0
    if precision == "fp32":
        return bool(np.allclose(got, reference, rtol=1e-4, atol=1e-5 * scale))
    r, g = reference.astype(np.float64).ravel(), got.astype(np.float64).ravel()
    norms = float(np.linalg.norm(r) * np.linalg.norm(g))
    cosine = float(r @ g) / norms if norms else float(np.array_equal(r, g))
    return cosine >= 0.9999 and float(np.max(np.abs(r - g), initial=0.0)) <= 1e-2 * scale
