"""Graph scopes: an If/Loop/Scan body must produce its own outputs.

A body may read any value of an enclosing graph, but each of its outputs must come out of one
of its own nodes (or be its own input or initializer); ONNX Runtime refuses the model otherwise.
PyTorch exports of control flow end their branches in `Identity(outer_value)`, and those
Identity nodes are exactly the ones that must stay. onnx_ir's `IdentityEliminationPass`
removes them (renaming the outer value after the body's output, and raising when two
branches forward the same value), so Kiln eliminates identities with the scope rule below
and checks after every pass that no body output was left unproduced.
"""

from __future__ import annotations

from collections.abc import Iterator

import onnx_ir as ir


class ScopedIdentityEliminationPass(ir.passes.InPlacePass):
    """Removes Identity nodes from the main graph, If/Loop/Scan bodies and functions.

    Guarantee: outputs bit-identical; every graph output keeps its name and stays produced
    in its own graph. `y = Identity(x)` goes when `y` is no graph output (its users read
    `x`), or when `x` is made by a node of the same graph and is not itself a graph output
    (then `x` takes `y`'s name). An Identity forwarding a graph input, an initializer, an
    outer-scope value or another output to a graph output stays.
    """

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        removed = 0
        for graph_like in (model.graph, *model.functions.values()):
            for node in ir.traversal.RecursiveGraphIterator(graph_like):
                if _removable(node):
                    _bypass(node)
                    removed += 1
        return ir.passes.PassResult(model, modified=removed > 0)


def _removable(node: ir.Node) -> bool:
    if node.op_type != "Identity" or node.domain not in ("", "ai.onnx"):
        return False
    if len(node.inputs) != 1 or len(node.outputs) != 1 or node.inputs[0] is None:
        return False
    source, out = node.inputs[0], node.outputs[0]
    if not out.is_graph_output():
        return True
    producer = source.producer()
    return producer is not None and producer.graph is node.graph and not source.is_graph_output()


def _bypass(node: ir.Node) -> None:
    source, out = node.inputs[0], node.outputs[0]
    if source.shape is None:
        source.shape = out.shape
    if source.type is None:
        source.type = out.type
    was_output, name = out.is_graph_output(), out.name
    ir.convenience.replace_all_uses_with(out, source, replace_graph_outputs=was_output)
    if was_output:
        source.name = name  # the graph's interface keeps its names
    node.graph.remove(node, safe=True)


def _graphs(model: ir.Model) -> Iterator[tuple[ir.Graph | ir.Function, str]]:
    """Every graph of the model with words that say where it is."""
    yield model.graph, "the main graph"
    owners = [(model.graph, None), *((f, f"function {f.name}") for f in model.functions.values())]
    for graph_like, where in owners:
        if where is not None:
            yield graph_like, where
        for node in ir.traversal.RecursiveGraphIterator(graph_like):
            for attr in node.attributes.values():
                if attr.type == ir.AttributeType.GRAPH:
                    yield attr.as_graph(), f"the {attr.name} of {node.op_type} node '{node.name}'"
                elif attr.type == ir.AttributeType.GRAPHS:
                    for i, sub in enumerate(attr.as_graphs()):
                        yield sub, f"the {attr.name}[{i}] of {node.op_type} node '{node.name}'"


def _own(graph: ir.Graph | ir.Function, value: ir.Value) -> bool:
    """Whether `graph` itself makes `value`: one of its nodes, inputs or initializers."""
    producer = value.producer()
    if producer is not None:
        return producer.graph is (graph.graph if isinstance(graph, ir.Function) else graph)
    if any(value is v for v in graph.inputs):
        return True
    initializers = getattr(graph, "initializers", {})
    return value.name in initializers and initializers[value.name] is value


def stray_outputs(model: ir.Model) -> set[str]:
    """Graph outputs that their graph does not make, each as a sentence naming it (its
    position, name and graph). A valid model has none."""
    return {
        f"output {index} ('{value.name}') of {where} is made by no node there"
        for graph, where in _graphs(model)
        for index, value in enumerate(graph.outputs)
        if value is not None and not _own(graph, value)
    }
