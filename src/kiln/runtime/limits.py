"""The largest size each dynamic dim of a model's inputs can take, found in the graph.

A transformer cannot run a sequence longer than its position table: BERT slices
`position_ids[:, :seq]` out of a [1, 64] initializer, GPT-2 gathers `wpe[Range(0, seq)]` from a
[64, H] one and slices its causal mask `bias[..., :seq, :seq]`. Past the table, ONNX Runtime
fails deep inside the graph, after it has allocated (and kept, in its arena) the activations
of every node before the failure: a 1.2M-token request to bert-tiny cost 1 GB for an answer of
400. Knowing the limit, a session refuses such a request before it runs.

The analysis follows the values that carry a dim's size (Shape → Gather/Slice → Unsqueeze,
Squeeze, Cast, Concat) to the two places a size indexes a constant table:
- `Slice(table, starts=0, ends=[.., dim, ..], axes)`: dim ≤ the table's extent on that axis;
- `Gather(table, Range(start ≥ 0, dim, 1))` (through Unsqueeze/Reshape/Expand/Cast): dim ≤
  the table's extent on the gathered axis.
Only exact sizes are followed (dim − 1 or 2·dim are not), tables must be constants, and an
extent of 1 is ignored (it broadcasts): a bound found is one the model really has; a model
whose limits hide elsewhere gets none, and its requests run as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from kiln.errors import KilnError

# Ops that pass a size (or a vector of sizes) through unchanged.
_SIZE_PASS = {"Unsqueeze", "Squeeze", "Cast", "Identity", "Reshape", "Flatten"}
# Ops that pass the values of a Range (positions) through unchanged.
_INDEX_PASS = _SIZE_PASS | {"Expand"}

Entry = str | int | None  # a dim's name, a known int, or unknown
Layout = dict[str, list[int | str | None]]


@dataclass(frozen=True)
class DimLimit:
    """`dim` takes at most `limit`; `reason` names the table that sets it."""

    dim: str
    limit: int
    reason: str


def dim_limits(model: ir.Model, layout: Layout) -> dict[str, DimLimit]:
    """The upper bound of every dynamic dim the graph bounds (the tightest, where several)."""
    sizes: dict[ir.Value, list[Entry]] = {}  # values holding a vector of sizes
    ranges: dict[ir.Value, str] = {}  # values holding positions 0..dim-1 (or a sub-range)
    found: dict[str, DimLimit] = {}

    def bound(dim: Entry, table: ir.Value, axis: int, how: str) -> None:
        shape = table.shape
        if not isinstance(dim, str) or shape is None or not -shape.rank() <= axis < shape.rank():
            return
        extent = shape[axis]
        if not isinstance(extent, int) or extent <= 1:
            return
        if dim not in found or extent < found[dim].limit:
            reason = f"{how} '{table.name}' has {extent} along axis {axis % shape.rank()}"
            found[dim] = DimLimit(dim, extent, reason)

    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        op, ins = node.op_type, list(node.inputs)
        if node.domain not in ("", "ai.onnx") or not node.outputs:
            continue
        out = node.outputs[0]
        first = ins[0] if ins else None
        if op == "Shape" and first is not None and first.name in layout:
            dims: list[Entry] = list(layout[first.name])
            start, end = node.attributes.get_int("start", 0), node.attributes.get_int("end")
            sizes[out] = dims[start:end] if end is not None else dims[start:]
        elif op == "Gather" and first in sizes:
            index = _ints(ins[1])
            vector = sizes[first]
            if index is not None and all(-len(vector) <= i < len(vector) for i in index):
                sizes[out] = [vector[i] for i in index]
        elif op == "Gather" and first is not None and _is_constant(first) and ins[1] in ranges:
            axis = node.attributes.get_int("axis", 0)
            bound(ranges[ins[1]], first, axis, "the table")
        elif op == "Slice" and first in sizes:
            part = _sliced(sizes[first], ins)
            if part is not None:
                sizes[out] = part
        elif op == "Slice" and first is not None and _is_constant(first) and len(ins) > 2:
            _slice_bounds(first, ins, sizes, bound)
        elif op == "Concat" and all(v in sizes or _ints(v) is not None for v in ins):
            sizes[out] = [e for v in ins for e in (sizes[v] if v in sizes else _ints(v) or [])]
        elif op in _SIZE_PASS and first in sizes:
            sizes[out] = sizes[first]
        elif op == "Range" and len(ins) == 3 and ins[1] in sizes and len(sizes[ins[1]]) == 1:
            start, delta = _ints(ins[0]), _ints(ins[2])
            dim = sizes[ins[1]][0]
            if isinstance(dim, str) and start and start[0] >= 0 and delta == [1]:
                ranges[out] = dim
        elif op in _INDEX_PASS and first in ranges:
            ranges[out] = ranges[first]
    return found


def _slice_bounds(table: ir.Value, ins: list, sizes: dict, bound) -> None:
    """Slice(table, starts, ends, axes): each `ends` entry that is a dim bounds that dim."""
    starts, ends = _ints(ins[1]), sizes.get(ins[2])
    axes = _ints(ins[3]) if len(ins) > 3 and ins[3] is not None else None
    steps = _ints(ins[4]) if len(ins) > 4 and ins[4] is not None else None
    if starts is None or ends is None or len(starts) != len(ends):
        return
    axes = axes if axes is not None else list(range(len(ends)))
    if len(axes) != len(ends) or (steps is not None and any(s != 1 for s in steps)):
        return
    for start, end, axis in zip(starts, ends, axes, strict=True):
        if start >= 0:
            bound(end, table, axis, "the table")


def _sliced(vector: list[Entry], ins: list) -> list[Entry] | None:
    """Slice of a size vector with constant starts/ends (axis 0, step 1)."""
    starts, ends = _ints(ins[1]), _ints(ins[2]) if len(ins) > 2 else None
    steps = _ints(ins[4]) if len(ins) > 4 and ins[4] is not None else [1]
    if not starts or not ends or len(starts) != 1 or steps != [1]:
        return None
    return vector[starts[0] : ends[0]]


def _is_constant(value: ir.Value) -> bool:
    return value.is_initializer() or (
        value.producer() is not None and value.producer().op_type == "Constant"
    )


def _ints(value: ir.Value | None) -> list[int] | None:
    """A small constant integer tensor's values (initializer or Constant), else None."""
    if value is None:
        return None
    tensor = value.const_value
    if tensor is None and value.producer() is not None and value.producer().op_type == "Constant":
        attribute = value.producer().attributes.get("value")
        tensor = attribute.value if attribute is not None else None
    if tensor is None or tensor.size > 64 or not tensor.dtype.is_integer():
        return None
    try:
        return [int(v) for v in np.asarray(tensor.numpy()).reshape(-1)]
    except Exception:  # noqa: BLE001 (external data gone, odd types: no constant known)
        return None


def check_limits(
    dims: dict[str, int],
    limits: dict[str, DimLimit],
    feeds: dict[str, np.ndarray],
    layout: Layout,
    where: str,
) -> None:
    """KilnError naming the input, the dim and its limit for the first dim past its limit."""
    for dim, value in dims.items():
        limit = limits.get(dim)
        if limit is None or value <= limit.limit:
            continue
        name = next(n for n, axes in layout.items() if dim in axes)
        raise KilnError(
            f"{where}: input '{name}' has {dim}={value} (shape {list(np.shape(feeds[name]))}), "
            f"but the model takes at most {dim}={limit.limit} ({limit.reason}); split or "
            f"truncate the input to {dim} ≤ {limit.limit}."
        )


def max_shape(axes: list[int | str | None], limits: dict[str, DimLimit]) -> list[int]:
    """An input's largest shape: fixed sizes, each dim's limit, -1 where there is none."""
    out = []
    for axis in axes:
        if isinstance(axis, int):
            out.append(axis)
        else:
            limit = limits.get(axis) if axis is not None else None
            out.append(limit.limit if limit is not None else -1)
    return out
