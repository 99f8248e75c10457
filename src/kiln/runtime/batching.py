"""Running several requests as one (`Session.run_batch`, the server's dynamic batching).

Requests are concatenated along the batch dim only where that cannot change an answer: the
batch dim is axis 0 of every input and of every output asked for, and padding it was checked
safe (rows independent, see padding.py). Within a group, the other dims are padded to the
group's largest value where padding them is safe; where it is not, only requests of equal
size on them are grouped. Each group's outputs are split back per request.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from kiln.runtime.padding import Layout, Verdict, pad_feeds, slice_outputs, symbolic_dims

Feeds = dict[str, np.ndarray]
# Runs merged feeds: (output names, feeds, their dims, requests in them, real input elements).
Execute = Callable[[list[str], Feeds, dict[str, int], int, int], list[np.ndarray]]


@dataclass(frozen=True)
class Plan:
    """What batching needs to know about the model and the session."""

    layout: Layout
    batch_dims: set[str]
    verdict: Callable[[str], Verdict]  # padding safety per dim (checked once, then cached)
    buckets: Mapping[str, list[int]]  # the set in use: a merged batch must fit its largest


def elements(feeds: Feeds) -> int:
    return sum(int(np.size(a)) for a in feeds.values())


def run_batch(
    requests: list[Feeds],
    shapes: list[dict[str, int]],
    names: list[str],
    plan: Plan,
    execute: Execute,
) -> list[list[np.ndarray]]:
    """Each request's outputs, in order; `shapes` are the requests' dims (already checked)."""
    batch = concat_dim(plan, names)
    if batch is None:  # nothing can be merged: one run per request
        return [
            execute(names, feeds, dims, 1, elements(feeds))
            for feeds, dims in zip(requests, shapes, strict=True)
        ]
    paddable = {d for d in symbolic_dims(plan.layout) if d != batch and plan.verdict(d).allowed}
    results: list[list[np.ndarray]] = [[] for _ in requests]
    for members in groups(shapes, batch, paddable):
        for chunk in chunks(members, shapes, batch, plan.buckets.get(batch, [])):
            merged = _run_chunk(chunk, requests, shapes, names, batch, paddable, plan, execute)
            for i, outputs in zip(chunk, merged, strict=True):
                results[i] = outputs
    return results


def concat_dim(plan: Plan, names: list[str]) -> str | None:
    """The batch dim requests can be concatenated along: axis 0 of every input, padding it
    checked safe (rows independent), and axis 0 (only) of every output asked for."""
    firsts = {dims[0] if dims else None for dims in plan.layout.values()}
    if len(firsts) != 1:
        return None
    batch = firsts.pop()
    if not isinstance(batch, str) or batch not in plan.batch_dims:
        return None
    verdict = plan.verdict(batch)
    if not verdict.allowed or any(verdict.axes.get(n) != [0] for n in names):
        return None
    return batch


def groups(shapes: list[dict[str, int]], batch: str, paddable: set[str]) -> list[list[int]]:
    """Request indices grouped by their sizes on the dims that can be neither concatenated
    nor padded: only such equal requests can share a run."""
    found: dict[tuple[tuple[str, int], ...], list[int]] = {}
    for i, dims in enumerate(shapes):
        fixed = tuple((d, v) for d, v in sorted(dims.items()) if d != batch and d not in paddable)
        found.setdefault(fixed, []).append(i)
    return list(found.values())


def chunks(
    members: list[int], shapes: list[dict[str, int]], batch: str, sizes: list[int]
) -> list[list[int]]:
    """Split so that each chunk's total batch fits the largest batch bucket (if any): a
    bigger merged batch would miss every bucket and run on the slower dynamic executable."""
    if not sizes:
        return [members]
    out: list[list[int]] = [[]]
    total = 0
    for i in members:
        rows = shapes[i][batch]
        if out[-1] and total + rows > sizes[-1]:
            out.append([])
            total = 0
        out[-1].append(i)
        total += rows
    return out


def _run_chunk(
    chunk: list[int],
    requests: list[Feeds],
    shapes: list[dict[str, int]],
    names: list[str],
    batch: str,
    paddable: set[str],
    plan: Plan,
    execute: Execute,
) -> list[list[np.ndarray]]:
    """Pad the chunk's requests to a common size, run them as one, split the outputs back."""
    first = shapes[chunk[0]]
    common = {d: max(shapes[i][d] for i in chunk) for d in paddable if d in first}
    padded = [pad_feeds(requests[i], plan.layout, common, plan.batch_dims) for i in chunk]
    feeds = {n: np.concatenate([p[n] for p in padded], axis=0) for n in padded[0]}
    dims = {**first, **common, batch: sum(shapes[i][batch] for i in chunk)}
    real = sum(elements(requests[i]) for i in chunk)
    outputs = execute(names, feeds, dims, len(chunk), real)
    axes = {d: plan.verdict(d).axes for d in [batch, *common]}
    results, start = [], 0
    for i in chunk:
        rows = slice(start, start + shapes[i][batch])
        start = rows.stop
        own = [o[rows] for o in outputs]  # concat_dim checked: batch is axis 0 of each
        results.append(slice_outputs(own, names, axes, {d: shapes[i][d] for d in common}))
    return results
