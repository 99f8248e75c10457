"""Where a chain of layers falls apart: the points in the node order where one tensor carries
everything on.

A model with no independent branches (an encoder: layer after layer) can still run each stretch
on the engine fastest at it — one engine's GEMMs, the other's attention. A cut point is a place
in the node order after which exactly one computed tensor is read again. Tensors the model
computes from its inputs alone, without its weights or a heavy op (masks, position ids, shapes),
do not count: every part that reads one recomputes it from the model's inputs, which costs what
reading the inputs costs. The stretches between cut points are segments; a segment with no heavy
op (a LayerNorm, the embeddings' gathers) joins its neighbour, as a hand-off would cost more
than it could win.

The placement is a shortest path: each segment on each engine as measured, a hand-off where two
neighbours run on different engines; neighbours on one engine become one part.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import onnx_ir as ir

from kiln.ir.subgraph import captured
from kiln.partition.graph import HEAVY, PartCut, light_tensors


@dataclass(frozen=True)
class Chained:
    """Engines per segment, the predicted time of the chain, and the parts they make."""

    engines: list[str]  # per segment
    predicted_ms: float
    parts: list[PartCut]
    part_engines: list[str]


def chain_cuts(model: ir.Model) -> list[PartCut]:
    """The model's segments in order (see the module docstring); one cut when there is no
    cut point."""
    graph = model.graph
    inputs = [v.name for v in graph.inputs if v.name not in graph.initializers]
    light = light_tensors(graph, set(inputs))
    nodes = [n for n in graph if not all(v.name in light for v in n.outputs)]
    readers = _last_reader(nodes)
    segments: list[list[ir.Node]] = [[]]
    live: set[str] = set()
    for index, node in enumerate(nodes):
        segments[-1].append(node)
        live -= {n for n in live if readers.get(n, -1) <= index}
        live |= {v.name for v in node.outputs if readers.get(v.name, -1) > index}
        if len(live) == 1 and index < len(nodes) - 1:
            segments.append([])
    segments = _merge_light(segments)
    return [_cut(graph, inputs, light, seg, segments, i) for i, seg in enumerate(segments)]


def place_chain(
    segments: Sequence[PartCut],
    part_ms: dict[str, dict[str, float]],
    handoff_ms: float,
    outputs: Sequence[str],
) -> Chained:
    """The engines that minimise the measured chain time (a hand-off where neighbours differ),
    and the parts: runs of neighbours on one engine."""
    engines = list(next(iter(part_ms.values())))
    # best[e]: the fastest chain so far ending on engine e, and its engines
    best = {e: (part_ms[segments[0].name][e], [e]) for e in engines}
    for segment in segments[1:]:
        step = {}
        for engine in engines:
            came = min(
                (cost + (handoff_ms if prev != engine else 0.0), path)
                for prev, (cost, path) in best.items()
            )  # fmt: skip
            step[engine] = (came[0] + part_ms[segment.name][engine], [*came[1], engine])
        best = step
    total, path = min(best.values())
    changes = [e for i, e in enumerate(path) if i == 0 or path[i - 1] != e]
    return Chained(path, total, merge_runs(segments, path, outputs), changes)


def merge_runs(
    segments: Sequence[PartCut], engines: Sequence[str], outputs: Sequence[str]
) -> list[PartCut]:
    """Neighbouring segments on one engine as one cut (`outputs`: the model's)."""
    runs: list[list[PartCut]] = []
    for index, segment in enumerate(segments):
        if index and engines[index] == engines[index - 1]:
            runs[-1].append(segment)
        else:
            runs.append([segment])
    return [_joined(run, segments, set(outputs)) for run in runs]


def _last_reader(nodes: list[ir.Node]) -> dict[str, int]:
    """Tensor → the index of the last node (of `nodes`) that reads it, bodies' reads included."""

    last: dict[str, int] = {}
    for index, node in enumerate(nodes):
        for value in (*node.inputs, *captured(node)):
            if value is not None and value.name:
                last[value.name] = index
    return last


def _merge_light(segments: list[list[ir.Node]]) -> list[list[ir.Node]]:
    """Segments without a heavy op joined to the one before (the first: to the one after)."""
    out: list[list[ir.Node]] = []
    carry: list[ir.Node] = []
    for segment in segments:
        if not segment:
            continue
        if any(n.op_type in HEAVY for n in segment):
            out.append(carry + segment)
            carry = []
        elif out:
            out[-1].extend(segment)
        else:
            carry.extend(segment)
    if carry:
        out.append(carry)
    return out


def _cut(
    graph: ir.Graph,
    inputs: list[str],
    light: set[str],
    segment: list[ir.Node],
    segments: list[list[ir.Node]],
    index: int,
) -> PartCut:
    """A segment as a cut: what it reads from earlier segments (a light tensor: the model
    inputs it comes from) in, what later segments or the user read out."""

    made = {v.name for n in segment for v in n.outputs}
    earlier = {v.name for s in segments[:index] for n in s for v in n.outputs}
    reads = [v.name for n in segment for v in (*n.inputs, *captured(n)) if v is not None]
    outer = [r for r in dict.fromkeys(reads) if r not in made and r not in graph.initializers]
    wanted = {r for r in outer if r in light} | {r for r in outer if r in inputs}
    roots = _roots(graph, wanted, set(inputs))
    ins = [r for r in outer if r in earlier and r not in light]
    ins += [i for i in inputs if i in roots]
    later = {
        v.name
        for s in segments[index + 1 :]
        for n in s
        for v in (*n.inputs, *captured(n))
        if v is not None
    }  # fmt: skip
    outputs = {v.name for v in graph.outputs}
    outs = [v.name for n in segment for v in n.outputs if v.name in later or v.name in outputs]
    return PartCut(_name(segment, index), tuple(ins), tuple(outs), len(segment), branch=False)


def _roots(graph: ir.Graph, names: set[str], inputs: set[str]) -> set[str]:
    """The model inputs the tensors `names` are computed from."""
    producers = {v.name: n for n in graph for v in n.outputs}
    found, stack, seen = set(), list(names), set()
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        if name in inputs:
            found.add(name)
        elif name in producers:
            stack += [v.name for v in producers[name].inputs if v is not None]
    return found


def _joined(run: list[PartCut], segments: Sequence[PartCut], outputs: set[str]) -> PartCut:
    """Neighbouring cuts as one: the inputs none of them makes, the outputs read after them
    or by the user."""
    made = {o for c in run for o in c.outputs}
    ins = list(dict.fromkeys(i for c in run for i in c.inputs if i not in made))
    after = segments[segments.index(run[-1]) + 1 :]
    read_after = {i for c in after for i in c.inputs}
    outs = [o for c in run for o in c.outputs if o in read_after or o in outputs]
    name = run[0].name if len(run) == 1 else f"{run[0].name}-{run[-1].name}"
    return PartCut(name, tuple(ins), tuple(dict.fromkeys(outs)), sum(c.nodes for c in run), False)


def _name(segment: list[ir.Node], index: int) -> str:
    """`sNN_` and the longest dotted scope most of the segment's heavy nodes share
    (`encoder.layer.3.attention`), file-name safe."""
    heavy = [n.name or "" for n in segment if n.op_type in HEAVY] or [""]
    parts = [p.split(".") for p in heavy]
    common: list[str] = []
    for words in zip(*parts, strict=False):
        if len(set(words)) != 1:
            break
        common.append(words[0])
    scope = ".".join(common[:4]) if len(common) > 1 else ""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in scope)
    return f"s{index:02d}" + (f"_{safe}" if safe else "")
