"""A graph as the debugger's page draws it: nodes in topological order, each with its name
scope (the page groups and collapses by it), the nodes it reads from and the tensors it makes.

The page lays the graph out itself (a layered layout by topological rank), so what leaves here
is structure, not coordinates. A compiled graph's nodes also carry the original nodes and passes
behind them, and the precision they run in; a node a pass created takes the scope its original
nodes share, so `node_Attention_24` sits in `encoder / layer.0 / attention / self`.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import Any

import onnx_ir as ir

Describe = Callable[[ir.Node], dict[str, Any]]


def topological(model: ir.Model) -> list[ir.Node]:
    """The graph's nodes, producers first: the stored order where it already is one (ONNX
    requires it, but a pass may have appended a node before its producers), else the order
    that keeps each node as early in the stored order as its inputs allow."""
    nodes = list(model.graph)
    producer = {v.name: i for i, n in enumerate(nodes) for v in n.outputs if v.name}
    needs = [
        {producer[v.name] for v in n.inputs if v is not None and v.name in producer} - {i}
        for i, n in enumerate(nodes)
    ]
    if all(j < i for i, wanted in enumerate(needs) for j in wanted):
        return nodes
    consumers: dict[int, list[int]] = {}
    for i, wanted in enumerate(needs):
        for j in wanted:
            consumers.setdefault(j, []).append(i)
    ready = [i for i, wanted in enumerate(needs) if not wanted]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for k in consumers.get(i, []):
            needs[k].discard(i)
            if not needs[k]:
                heapq.heappush(ready, k)
    if len(order) < len(nodes):  # a cycle (not a valid ONNX graph): the rest as stored
        seen = set(order)
        order += [i for i in range(len(nodes)) if i not in seen]
    return [nodes[i] for i in order]


def scope_of(name: str) -> list[str]:
    """The name scope of a node name: `/encoder/layer.3/attention/MatMul` (PyTorch's
    exporter) and `encoder.layer.3.attention.MatMul` both give ["encoder", "layer.3",
    "attention"]; a number stays with the word before it."""
    if "/" in name:
        parts = [part for part in name.split("/") if part]
    else:
        parts = []
        for piece in name.split("."):
            if piece.isdigit() and parts:
                parts[-1] += "." + piece
            else:
                parts.append(piece)
    return parts[:-1]


def shared_scope(names: Iterable[str]) -> list[str]:
    """The longest scope every name lies in."""
    scopes = [scope_of(name) for name in names]
    if not scopes:
        return []
    common = scopes[0]
    for scope in scopes[1:]:
        length = 0
        while length < min(len(common), len(scope)) and common[length] == scope[length]:
            length += 1
        common = common[:length]
    return common


def op_name(node: ir.Node) -> str:
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"


def graph_json(model: ir.Model, describe: Describe | None = None) -> dict[str, Any]:
    """Nodes in topological order: `id` (the node name), `op`, `scope`, `in` (indices of the
    nodes it reads from), `outputs` (tensor names), and what `describe` adds for the node."""
    producer: dict[str, int] = {}
    nodes = []
    for index, node in enumerate(topological(model)):
        reads = {producer[v.name] for v in node.inputs if v is not None and v.name in producer}
        entry = {
            "id": node.name,
            "op": op_name(node),
            "scope": scope_of(node.name or ""),
            "in": sorted(reads),
            "outputs": [v.name for v in node.outputs if v.name],
        }
        if describe is not None:
            entry.update(describe(node))
        nodes.append(entry)
        for value in node.outputs:
            if value.name:
                producer[value.name] = index
    graph = model.graph
    return {
        "name": graph.name or "main_graph",
        "nodes": nodes,
        "inputs": [v.name for v in graph.inputs if v.name not in graph.initializers],
        "outputs": [v.name for v in graph.outputs],
    }


def value_json(value: ir.Value | None) -> dict[str, Any]:
    """A tensor as the node panel lists it: name, shape and element type where known."""
    if value is None:
        return {"name": "", "shape": None, "dtype": None}
    shape = None
    if value.shape is not None:
        shape = [d if isinstance(d, int) else str(d.value) for d in value.shape]
    dtype = value.dtype.name.lower() if value.dtype is not None else None
    return {"name": value.name, "shape": shape, "dtype": dtype}


def attributes_json(node: ir.Node, limit: int = 80) -> dict[str, str]:
    """Attributes as short text (a subgraph or a long tensor is cut at `limit` characters)."""
    out = {}
    for name, attr in node.attributes.items():
        text = str(attr.value) if attr.type != ir.AttributeType.GRAPH else "<graph>"
        out[name] = text if len(text) <= limit else text[: limit - 1] + "…"
    return out
