"""Provenance: which original nodes, and which passes, every node came from.

Before the first pass every node is stamped `kiln.origin` = its own name. The onnxscript
rewriter copies metadata from matched nodes to their replacements; we register a merger that
takes the *union* of origins, so a fused node names every node it replaced. Passes that do not
go through the rewriter are covered by `track_pass`, which fills in what they left unstamped.
"""

from __future__ import annotations

from collections.abc import Iterator

import onnx_ir as ir

from kiln.ir.onnxscript_internals import register_metadata_merger

ORIGIN_KEY = "kiln.origin"
PASS_KEY = "kiln.pass"
SEPARATOR = ","


def _union(first: str, second: str) -> str:
    return join_origins(split_origins(first) | split_origins(second))


def split_origins(text: str) -> set[str]:
    return {part for part in text.split(SEPARATOR) if part}


def join_origins(origins: set[str]) -> str:
    return SEPARATOR.join(sorted(origins))


# The rewriter's own extension point for merging node metadata (one merger per key).
register_metadata_merger(ORIGIN_KEY, _union)
register_metadata_merger(PASS_KEY, _union)


def all_nodes(graph: ir.Graph | ir.Function) -> Iterator[ir.Node]:
    """Every node of the graph and of its subgraphs (If/Loop/Scan bodies), depth first."""
    for node in graph:
        yield node
        for attr in node.attributes.values():
            if attr.type == ir.AttributeType.GRAPH:
                yield from all_nodes(attr.as_graph())
            elif attr.type == ir.AttributeType.GRAPHS:
                for sub in attr.as_graphs():
                    yield from all_nodes(sub)


def stamp_origins(model: ir.Model) -> None:
    """Give every node a unique name and `kiln.origin` = that name."""
    seen: set[str] = set()
    for index, node in enumerate(all_nodes(model.graph)):
        name = node.name or f"{node.op_type}_{index}"
        while name in seen:
            name = f"{name}_{index}"
        seen.add(name)
        node.name = name
        node.metadata_props[ORIGIN_KEY] = name


def origins_of(node: ir.Node) -> set[str]:
    return split_origins(node.metadata_props.get(ORIGIN_KEY, ""))


class PassTracker:
    """Snapshot before a pass; afterwards stamp the nodes it created.

    A new node keeps the origins the rewriter merged into it. One the pass left bare gets the
    origins of the removed nodes that produced the same output names (constant folding and most
    hand-written passes keep output names), or else of the removed nodes it is wired to.
    """

    def __init__(self, model: ir.Model, pass_name: str) -> None:
        self.model = model
        self.pass_name = pass_name
        self.before = {id(node): node for node in all_nodes(model.graph)}

    def finish(self) -> int:
        """Stamp new nodes; return how many nodes the pass created."""
        after = {id(node): node for node in all_nodes(self.model.graph)}
        created = [node for key, node in after.items() if key not in self.before]
        removed = [node for key, node in self.before.items() if key not in after]
        removed_origins = set().union(*(origins_of(n) for n in removed)) if removed else set()
        _stamp_created(created, removed, self.pass_name, fallback=removed_origins)
        return len(created)


def stamp_rewritten(before: ir.Model, after: ir.Model, pass_name: str) -> int:
    """Provenance across a step that returns a new model instead of editing one in place (the
    quantizers' file round trip), by the same rules as `PassTracker`: a node of `after` that
    matches one of `before` by name and op keeps that node's stamps; every other node is new:
    it gets the origins of the node it is named after (`MatMul_3_quant` ← `MatMul_3`), else of
    the removed nodes whose outputs it produces, else of the nodes it is wired to, and
    `kiln.pass` gains `pass_name`. Returns how many nodes were new."""
    old = {(n.name, n.domain, n.op_type): n for n in all_nodes(before.graph) if n.name}
    matched: set[tuple] = set()
    created = []
    for node in all_nodes(after.graph):
        key = (node.name, node.domain, node.op_type)
        twin = old.get(key)
        if twin is None:
            created.append(node)
            continue
        matched.add(key)
        for meta in (ORIGIN_KEY, PASS_KEY):
            if meta in twin.metadata_props:
                node.metadata_props[meta] = twin.metadata_props[meta]
    known = {name: n for (name, _, _), n in old.items()}
    for node in created:
        name = node.name or ""
        prefix = max((k for k in known if k and name.startswith(k)), key=len, default=None)
        if prefix is not None and origins_of(known[prefix]):
            # It stands for that node: its origins, and the passes that made that node.
            for meta in (ORIGIN_KEY, PASS_KEY):
                if meta in known[prefix].metadata_props:
                    node.metadata_props[meta] = known[prefix].metadata_props[meta]
    removed = [n for key, n in old.items() if key not in matched]
    _stamp_created(created, removed, pass_name, fallback=set())
    return len(created)


def _stamp_created(
    created: list[ir.Node], removed: list[ir.Node], pass_name: str, fallback: set[str]
) -> None:
    """Origins for new nodes that have none, and `pass_name` added to every new node's passes."""
    by_output: dict[str, set[str]] = {}
    for node in removed:
        for value in node.outputs:
            by_output.setdefault(value.name or "", set()).update(origins_of(node))
    bare = [node for node in created if not origins_of(node)]
    while bare:  # a chain of new nodes (Q → DQ) learns its origins from the far end
        for node in bare:
            node.metadata_props[ORIGIN_KEY] = join_origins(_guess_origins(node, by_output))
        still = [node for node in bare if not origins_of(node)]
        if len(still) == len(bare):
            break
        bare = still
    for node in bare:
        node.metadata_props[ORIGIN_KEY] = join_origins(fallback)
    for node in created:
        passes = split_origins(node.metadata_props.get(PASS_KEY, "")) | {pass_name}
        node.metadata_props[PASS_KEY] = join_origins(passes)


def _guess_origins(node: ir.Node, by_output: dict[str, set[str]]) -> set[str]:
    found: set[str] = set()
    for value in node.outputs:
        found |= by_output.get(value.name or "", set())
    if found:
        return found
    neighbours = [v.producer() for v in node.inputs if v is not None and v.producer()]
    neighbours += [user for v in node.outputs for user, _ in v.uses()]
    for other in neighbours:
        if other is not None:
            found |= origins_of(other)
    return found
