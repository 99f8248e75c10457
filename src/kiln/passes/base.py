"""The base of every Kiln pass: an onnx_ir in-place pass that counts what it changed."""

from __future__ import annotations

import abc
import logging
from dataclasses import dataclass

import onnx_ir as ir

# onnx_ir's passes warn about what they leave alone: a model whose declared shapes contradict
# ONNX's inference (with a traceback, once per pass), an initializer that is also an output
# and so is not deduplicated. Kiln's pipeline runs them as its own steps and the result is
# verified; nothing there is for a user to act on, so it stays off the terminal.
logging.getLogger("onnx_ir.passes").setLevel(logging.ERROR)


class KilnPass(ir.passes.InPlacePass):
    """Subclasses set `name` and implement `apply`, returning how many rewrites they made.

    Guarantee of `call`: `PassResult.modified` is True when the model differs after the pass
    (a node added, removed, rewired, turned into another op or given other attributes; a
    value's type or shape; the graph's interface, initializers or functions) or `apply`
    reported rewrites. A rewrite in place that keeps the node count is a modification; a pass
    that matched nothing, or only re-derived what was already there, is not.
    """

    name: str = "unnamed"
    stage: str = "simplify"
    summary: str = ""  # one line for `--show-pipeline`
    count: int = 0  # rewrites made by the last call
    note: str = ""  # why the last call left the model as it was, where a measurement decided
    # Engines that can run what the pass emits; None: any (it emits standard ONNX only).
    engines: frozenset[str] | None = None

    @abc.abstractmethod
    def apply(self, model: ir.Model) -> int:
        """Rewrite `model` in place; return how many rewrites were made (in-place ones too)."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        before = ModelState.of(model)
        self.count = self.apply(model)
        return ir.passes.PassResult(
            model, modified=self.count > 0 or ModelState.of(model) != before
        )


@dataclass(frozen=True)
class ModelState:
    """A snapshot of what a pass can change, to tell afterwards whether it changed anything.

    Nodes, values and tensors are compared by identity (the snapshot holds them, so none can be
    freed and its identity reused while it lives); ops, attributes, types and shapes by value.
    """

    nodes: dict[ir.Node, tuple[object, ...]]  # node -> op, inputs, attributes, outputs
    annotations: tuple[object, ...]  # interfaces, initializers, functions, types and shapes

    @classmethod
    def of(cls, model: ir.Model) -> ModelState:
        nodes: dict[ir.Node, tuple[object, ...]] = {}
        annotations: list[object] = [tuple(model.functions.items())]
        for graph in model.graphs():
            initializers = tuple((k, v, v.const_value) for k, v in graph.initializers.items())
            annotations.append((graph, tuple(graph.inputs), tuple(graph.outputs), initializers))
            for node in graph:
                nodes[node] = (
                    node.domain,
                    node.op_type,
                    tuple(node.inputs),
                    tuple(node.attributes.items()),  # Attr compares by name, type and value
                    tuple((v, v.name) for v in node.outputs),
                )
                annotations.extend((v, v.type, str(v.shape), v.const_value) for v in node.outputs)
        return cls(nodes, tuple(annotations))

    def rewritten_nodes(self, after: ModelState) -> int:
        """Nodes added, removed, or changed in place (op, inputs, attributes, outputs) between
        this snapshot and `after`; type and shape annotations are not rewrites."""
        added_or_removed = self.nodes.keys() ^ after.nodes.keys()
        kept = self.nodes.keys() & after.nodes.keys()
        return len(added_or_removed) + sum(self.nodes[n] != after.nodes[n] for n in kept)
