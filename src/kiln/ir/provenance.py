"""Provenance: which original nodes, and which passes, every node came from.

Before the first pass every node is stamped `kiln.origin` = its own name. The onnxscript
rewriter copies metadata from matched nodes to their replacements; we register a merger that
takes the *union* of origins, so a fused node names every node it replaced. Passes that do not
go through the rewriter are covered by `track_pass`, which fills in what they left unstamped.
"""

from __future__ import annotations

from collections.abc import Iterator

import onnx_ir as ir
from onnxscript.rewriter import _rewrite_rule

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
_rewrite_rule._default_metadata_merger.mergers[ORIGIN_KEY] = _union
_rewrite_rule._default_metadata_merger.mergers[PASS_KEY] = _union


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
        by_output: dict[str, set[str]] = {}
        for node in removed:
            for value in node.outputs:
                by_output.setdefault(value.name or "", set()).update(origins_of(node))
        removed_origins = set().union(*(origins_of(n) for n in removed)) if removed else set()
        for node in created:
            if not origins_of(node):
                node.metadata_props[ORIGIN_KEY] = join_origins(
                    _guess_origins(node, by_output) or removed_origins
                )
            passes = split_origins(node.metadata_props.get(PASS_KEY, "")) | {self.pass_name}
            node.metadata_props[PASS_KEY] = join_origins(passes)
        return len(created)


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
