"""`kiln compare A PARTITIONED.kiln`: every part layer by layer against the original piece it
was compiled from, each on the tensors the *original* computes at the part's inputs — so a
part's error is its own, not carried in from the parts before it — and the first part (in
dependency order) with a layer beyond the budget, with that layer.

A gives the whole model's inputs (`--inputs`, else synthesized for A's graph); the reference
of each part is its piece (`NAME.kiln/parts/PART.onnx`) in ONNX Runtime as-is, and the pieces
run one after another compute the original's tensors at every boundary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.artifact.store import read_partitioned
from kiln.debug.compare import Comparison, compare_sides
from kiln.debug.sides import Say, load_side, synthesized_feeds
from kiln.errors import KilnError


def compare_parts(
    a: str,
    partitioned: str,
    *,
    inputs: str | None = None,
    shapes: dict[str, tuple[int, ...]] | None = None,
    metric: str = "auto",
    max_drop: float | None = None,
    say: Say = lambda _msg: None,
) -> dict[str, Comparison]:
    """Part name → its Comparison (piece → compiled part), in dependency order."""
    from kiln.ir.inputs import read_inputs

    _, section, _ = read_partitioned(partitioned)
    say(f"loading {a}")
    whole = load_side(a, inputs=inputs, shapes=shapes, say=say)
    graph = whole.original or whole.model
    needed = {n for spec in section.parts for n in spec.inputs}
    produced = {n for spec in section.parts for n in spec.outputs}
    given = {v.name for v in graph.graph.inputs}
    missing = sorted(needed - produced - given)
    if missing:
        raise KilnError(
            f"{a} does not take the input '{missing[0]}' {partitioned} needs: compare a "
            "partitioned artifact with the model it was built from."
        )
    if inputs is not None:
        values = dict(read_inputs(inputs, graph))
    else:
        values = dict(synthesized_feeds(graph, (whole,), shapes, say=say)[0])
    comparisons = {}
    for spec in section.parts:
        say(f"part {spec.name}: its piece against the compiled part")
        piece = load_side(str(Path(partitioned) / spec.piece))
        part = load_side(str(Path(partitioned) / spec.path))
        feeds = {n: values[n] for n in spec.inputs}
        comparisons[spec.name] = compare_sides(
            piece, part, feeds=feeds, metric=metric, max_drop=max_drop, say=say
        )
        # The original's tensors at this part's outputs: what the parts after it receive.
        values.update(comparisons[spec.name].outputs_a)
    return comparisons


def parts_json(a: str, partitioned: str, comparisons: dict[str, Comparison]) -> dict[str, Any]:
    """The comparisons in JSON, with the first part that diverges and its first layer."""
    parts = {name: c.to_json() for name, c in comparisons.items()}
    first = next(((n, p) for n, p in parts.items() if p["first_divergence"]), None)
    return {
        "a": a,
        "b": partitioned,
        "parts": parts,
        "first_divergence": (
            {"part": first[0], "node": first[1]["first_divergence"]} if first else None
        ),
    }
