"""Where a model falls apart: its independent branches and the join, found from the graph.

A node belongs to the branch of the model inputs it depends on. Inputs that some node (short
of the join) reads together belong to one branch: the image tower reads `image`, the text
tower `input_ids` and `attention_mask`. The join is every node that depends on more than one
branch. Each branch and the join become a candidate part: the branch's inputs in, what the join
(or the user) reads from it out. Nodes that depend on no input (constant computations) go with
every part that needs them, as `kiln.ir.subgraph.extract` takes them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import onnx_ir as ir

from kiln.ir.subgraph import extract

JOIN = "join"
# Ops whose work grows with the weights: a piece without one is not worth a hand-off.
HEAVY = frozenset({
    "MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum", "MatMulInteger", "QLinearMatMul",
    "QLinearConv", "ConvInteger", "LSTM", "GRU", "RNN", "Attention", "MultiHeadAttention",
    "FusedMatMul", "FusedConv", "FusedGemm", "QAttention", "DynamicQuantizeMatMul",
})  # fmt: skip


@dataclass(frozen=True)
class PartCut:
    """A part cut out of the model (a branch, the join, or a segment of a chain): the tensors
    it starts from and those it hands on."""

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    nodes: int
    branch: bool  # an independent branch (False: the join)


def find_cuts(model: ir.Model) -> list[PartCut]:
    """The model's branches and its join, in dependency order; one cut when the model has no
    independent branches (every node short of the outputs reads every input's branch)."""
    graph = model.graph
    inputs = [v.name for v in graph.inputs if v.name not in graph.initializers]
    deps = _dependencies(graph, set(inputs))
    light = light_tensors(graph, set(inputs))
    weighty = [n for n in graph if not all(v.name in light for v in n.outputs)]
    groups = _branches([deps[id(n)] for n in weighty if deps[id(n)]], inputs)
    if len(groups) < 2:
        outputs = tuple(v.name for v in graph.outputs)
        return [PartCut(JOIN, tuple(inputs), outputs, len(graph), branch=False)]
    owner = {id(n): _group_of(d, groups) for n, d in ((n, deps[id(n)]) for n in graph)}
    cuts = []
    for index, group in enumerate(groups):
        nodes = [n for n in graph if owner[id(n)] == index]
        outs = _handed_on(graph, nodes, owner, index)
        ins = tuple(i for i in inputs if i in group and _read_by(i, nodes))
        cuts.append(PartCut(_name(nodes, f"branch{index}"), ins, outs, len(nodes), branch=True))
    join = [n for n in graph if owner[id(n)] == -1 and deps[id(n)]]
    if join:
        made = {o for c in cuts for o in c.outputs}
        read = _read_from_outside(join)
        ins = tuple(sorted(read & (made | set(inputs)), key=_order(inputs, cuts)))
        outs = tuple(v.name for v in graph.outputs if v.name not in made)
        cuts.append(PartCut(JOIN, ins, outs, len(join), branch=False))
    return _unique_names(cuts)


def light_tensors(graph: ir.Graph, inputs: set[str]) -> set[str]:
    """Tensors computed from the model's inputs and constants that are not weights (vectors,
    scalars), by light ops (a mask, position ids, shapes): never a part of their own —
    whoever reads one recomputes it from the inputs, at what reading the inputs costs."""
    small = {n for n, v in graph.initializers.items() if not _is_weight(v)}
    light: set[str] = set()
    for node in graph:
        reads = [v.name for v in node.inputs if v is not None]
        if node.op_type in HEAVY or not reads or _has_body(node):
            continue
        if all(r in inputs or r in small or r in light for r in reads):
            light |= {v.name for v in node.outputs}
    return light


def _is_weight(value: ir.Value) -> bool:
    """A matrix or table (two dims or more above 1), or a value of unknown shape."""
    shape = value.shape
    if shape is None or not shape.is_static():
        return True
    return sum(1 for dim in shape if int(dim) > 1) >= 2


def _has_body(node: ir.Node) -> bool:
    return any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
               for a in node.attributes.values())  # fmt: skip


def pieces(model: ir.Model, cuts: list[PartCut]) -> dict[str, ir.Model]:
    """Each cut's piece of the model (provenance metadata kept)."""
    name = model.graph.name or "model"
    return {c.name: extract(model, c.inputs, c.outputs, f"{name}_{c.name}")
            for c in cuts}  # fmt: skip


def _dependencies(graph: ir.Graph, inputs: set[str]) -> dict[int, frozenset[str]]:
    """Node → the model inputs it depends on (graph order is topological)."""
    made: dict[str, frozenset[str]] = {}
    deps: dict[int, frozenset[str]] = {}
    for node in graph:
        found: set[str] = set()
        for value in node.inputs:
            if value is None:
                continue
            if value.name in inputs:
                found.add(value.name)
            found |= made.get(value.name, frozenset())
        deps[id(node)] = frozenset(found)
        for value in node.outputs:
            made[value.name] = deps[id(node)]
    return deps


def _branches(sets: list[frozenset[str]], inputs: list[str]) -> list[frozenset[str]]:
    """Groups of inputs read together short of the join: the dependency sets below all the
    inputs, merged where they overlap, in input order. Fewer than two: no independent
    branches."""
    every = set(inputs)
    groups: list[set[str]] = []
    for deps in sorted({d for d in sets if d != every}, key=len, reverse=True):
        overlapping = [g for g in groups if g & deps]
        merged = set(deps).union(*overlapping)
        groups = [g for g in groups if not g & deps] + [merged]
    if any(g == every for g in groups):
        return []
    return [frozenset(g) for g in sorted(groups, key=lambda g: min(inputs.index(i) for i in g))]


def _group_of(deps: frozenset[str], groups: list[frozenset[str]]) -> int:
    """The branch a node with these dependencies is in; -1 for the join (or no input)."""
    for index, group in enumerate(groups):
        if deps and deps <= group:
            return index
    return -1


def _handed_on(graph: ir.Graph, nodes: list[ir.Node], owner: dict[int, int], index: int):
    """What a branch's nodes make that another part or the user reads, in graph order."""
    outputs = {v.name for v in graph.outputs}
    out = []
    for node in nodes:
        for value in node.outputs:
            readers = [u.node for u in value.uses()]
            if value.name in outputs or any(owner.get(id(r)) != index for r in readers):
                out.append(value.name)
    return tuple(out)


def _read_by(name: str, nodes: list[ir.Node]) -> bool:
    return any(v is not None and v.name == name for n in nodes for v in n.inputs)


def _read_from_outside(nodes: list[ir.Node]) -> set[str]:
    made = {v.name for n in nodes for v in n.outputs}
    return {v.name for n in nodes for v in n.inputs if v is not None and v.name not in made}


def _order(inputs: list[str], cuts: list[PartCut]):
    """Sort key: model inputs first, then the branches' outputs in branch order."""
    rank = {name: i for i, name in enumerate(inputs)}
    for cut in cuts:
        for name in cut.outputs:
            rank.setdefault(name, len(rank))
    return lambda name: rank.get(name, len(rank))


def _name(nodes: list[ir.Node], fallback: str) -> str:
    """The scope most of the part's node names start with (`image.stage1.conv1` → image;
    `/text_model/encoder/...` → text_model), else `fallback`."""
    heads = Counter(_head(n.name or "") for n in nodes)
    heads.pop("", None)
    if not heads:
        return fallback
    head, count = heads.most_common(1)[0]
    return head if count * 2 >= len(nodes) else fallback


def _head(name: str) -> str:
    for separator in ("/", "."):
        name = name.strip(separator)
        if separator in name:
            return "".join(c if c.isalnum() or c in "-_" else "_" for c in name.split(separator)[0])
    return ""


def _unique_names(cuts: list[PartCut]) -> list[PartCut]:
    seen: set[str] = set()
    out = []
    for index, cut in enumerate(cuts):
        name = cut.name if cut.name not in seen else f"{cut.name}{index}"
        seen.add(name)
        out.append(PartCut(name, cut.inputs, cut.outputs, cut.nodes, cut.branch))
    return out
