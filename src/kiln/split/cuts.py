"""Where `kiln split` may cut a model, and what each cut is predicted to cost end to end.

A cut is a set of tensors of the main graph that separates it: every node that reads
something computed before the cut reads only the cut's tensors. The search considers every
single tensor that does (found from each node's ancestors, so a parallel branch scheduled
around it cannot hide it), the model's inputs (all on the server: the raw input is sent) and
its outputs (all on the edge: nothing is sent). Several tensors can be named with `--at a,b`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from kiln import units
from kiln.errors import KilnError
from kiln.ir.inputs import input_names
from kiln.ir.subgraph import extract
from kiln.split.codec import Codec

ALL_SERVER, ALL_EDGE, INNER = "all on server", "all on edge", "cut"


def parse_bandwidth(text: str | float) -> float:
    """'20Mbit/s', '200Mbit/s', '1Gbit/s', '5MB/s', '100kbps' (or bits/s as a number) → bits
    per second; decimal units, as links are sold (kiln.units reads it)."""
    try:
        return units.parse_bandwidth(text)
    except ValueError:
        raise KilnError(
            f"--bandwidth {text}: not a bandwidth above zero; write it as 20Mbit/s, 1Gbit/s or "
            "5MB/s."
        ) from None


@dataclass(frozen=True)
class SplitCut:
    """Boundary tensors, what kind of cut, the node after which it falls (for people), and
    the original nodes that run on the edge."""

    tensors: tuple[str, ...]
    kind: str
    after: str
    edge_nodes: frozenset[str] = field(compare=False, repr=False)

    @property
    def label(self) -> str:
        if self.kind != INNER:
            return self.kind
        return ",".join(self.tensors)


@dataclass
class Prediction:
    """One candidate cut with one codec: the predicted times and bytes on the wire."""

    cut: SplitCut
    codec: Codec
    edge_ms: float
    server_ms: float
    transfer_ms: float
    raw_bytes: int
    wire_bytes: int
    response_bytes: int
    verified: bool | None = None  # the codec's outputs within the budget (None: not tried)

    @property
    def total_ms(self) -> float:
        return self.edge_ms + self.transfer_ms + self.server_ms

    def to_json(self) -> dict:
        return {
            "cut": list(self.cut.tensors),
            "kind": self.cut.kind,
            "after": self.cut.after,
            "codec": self.codec.label,
            "edge_ms": self.edge_ms,
            "transfer_ms": self.transfer_ms,
            "server_ms": self.server_ms,
            "total_ms": self.total_ms,
            "raw_bytes": self.raw_bytes,
            "wire_bytes": self.wire_bytes,
            "response_bytes": self.response_bytes,
            "codec_verified": self.verified,
        }


def candidate_cuts(model: ir.Model) -> list[SplitCut]:
    """All on server, every single tensor that separates the graph (in graph order), all on
    edge."""
    graph = model.graph
    nodes = list(graph)
    dynamic = _dynamic_nodes(model)
    inputs = input_names(model)
    outputs = {v.name for v in graph.outputs}
    everything = frozenset(n.name for n in nodes if n.name)
    cuts = [SplitCut(tuple(inputs), ALL_SERVER, "(the input)", frozenset())]
    for node in nodes:
        if id(node) not in dynamic:
            continue
        for value in node.outputs:
            if value.name and value.name not in outputs and value.uses():
                ancestors = _separates(value, dynamic, inputs, outputs)
                if ancestors is not None:
                    cuts.append(SplitCut((value.name,), INNER, node.name or "", ancestors))
    cuts.append(SplitCut(tuple(sorted(outputs)), ALL_EDGE, "(the output)", everything))
    return cuts


def _dynamic_nodes(model: ir.Model) -> set[int]:
    """Nodes that depend on a model input (the rest is constant: each side recomputes it)."""
    live = set(input_names(model))
    found: set[int] = set()
    for node in model.graph:  # topological order
        if any(v is not None and v.name in live for v in node.inputs) or _reads_outer(node, live):
            found.add(id(node))
            live |= {v.name for v in node.outputs if v.name}
    return found


def _reads_outer(node: ir.Node, live: set[str]) -> bool:
    """A control-flow node whose body reads a live tensor of the main graph."""
    for attr in node.attributes.values():
        bodies = [attr.value] if attr.type == ir.AttributeType.GRAPH else (
            list(attr.value) if attr.type == ir.AttributeType.GRAPHS else [])  # fmt: skip
        for body in bodies:
            for inner in ir.traversal.RecursiveGraphIterator(body):
                if any(v is not None and v.name in live for v in inner.inputs):
                    return True
    return False


def _separates(
    value: ir.Value, dynamic: set[int], inputs: list[str], outputs: set[str]
) -> frozenset[str] | None:
    """The original nodes up to and including `value`'s producer, if `value` alone carries
    everything the rest of the graph needs from them; else None."""
    before = _ancestors(value.producer())
    inside = {id(n) for n in before}
    for node in before:
        for out in node.outputs:
            if out is value or not out.name:
                continue
            if out.name in outputs:
                return None  # a model output computed before the cut
            if any(id(user) not in inside for user, _ in out.uses()):
                return None
    graph = value.producer().graph
    for name in inputs:
        source = next(v for v in graph.inputs if v.name == name)
        if any(id(user) not in inside for user, _ in source.uses()):
            return None  # the rest reads a model input too
    return frozenset(n.name for n in before if n.name and id(n) in dynamic)


def _ancestors(node: ir.Node) -> list[ir.Node]:
    seen: dict[int, ir.Node] = {}
    stack = [node]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen[id(current)] = current
        for value in current.inputs:
            if value is not None and value.producer() is not None:
                stack.append(value.producer())
    return list(seen.values())


def resolve_cut(model: ir.Model, at: str, cuts: list[SplitCut]) -> SplitCut:
    """`--at`: a node name (its output), a tensor name, or tensors joined by commas."""
    names = [n.strip() for n in at.split(",") if n.strip()]
    if not names:
        raise KilnError("--at: give a node or tensor name, several tensors joined by ',', or auto.")
    tensors = tuple(_tensor_of(model, name) for name in names)
    for cut in cuts:
        if set(cut.tensors) == set(tensors):
            return cut
    if len(tensors) == 1:
        _refuse_single(model, tensors[0], cuts)
    return _multi_cut(model, tensors)


def _tensor_of(model: ir.Model, name: str) -> str:
    graph = model.graph
    node = next((n for n in graph if n.name == name), None)
    if node is not None:
        outs = [v.name for v in node.outputs if v.name]
        if len(outs) != 1:
            raise KilnError(
                f"--at {name}: node '{name}' computes {len(outs)} tensors ({', '.join(outs)}); "
                "name the tensor to cut at."
            )
        return outs[0]
    known = {v.name for v in graph.inputs} | {v.name for n in graph for v in n.outputs}
    if name in known:
        return name
    # Not on the main graph: extract says whether it lies inside a control-flow body.
    try:
        extract(model, [name], [v.name for v in graph.outputs])
    except KilnError as exc:
        raise KilnError(f"--at {name}: {exc}") from None
    raise KilnError(f"--at {name}: '{name}' is neither a node nor a tensor of the model.")


def _refuse_single(model: ir.Model, tensor: str, cuts: list[SplitCut]) -> None:
    """A tensor that does not separate the graph: say what crosses it and where one could cut."""
    inner = [c for c in cuts if c.kind == INNER]
    nearby = ", ".join(c.tensors[0] for c in inner[:8]) or "none (cut at the input or output)"
    more = f" (and {len(inner) - 8} more)" if len(inner) > 8 else ""
    raise KilnError(
        f"--at {tensor}: the cut does not separate the graph of {model.graph.name or 'the model'}"
        f": nodes after '{tensor}' also read tensors computed before it (a parallel branch or "
        f"a skip connection). Cut at a tensor that does: {nearby}{more}."
    )


def _multi_cut(model: ir.Model, tensors: tuple[str, ...]) -> SplitCut:
    """Several tensors named together: extract checks that they separate the graph."""
    outputs = [v.name for v in model.graph.outputs]
    server = extract(model, list(tensors), outputs)  # raises when a path goes around them
    on_server = {n.name for n in server.graph}
    edge = frozenset(n.name for n in model.graph if n.name and n.name not in on_server)
    return SplitCut(tensors, INNER, ",".join(tensors), edge)


def predict_cut(
    cut: SplitCut,
    codec: Codec,
    edge_times: dict[str, float],
    server_times: dict[str, float],
    boundary: dict[str, np.ndarray],
    response_bytes: int,
    link: tuple[float, float],
) -> Prediction:
    """Edge, transfer and server time of `cut` with `codec`; `link` is (bits/s, fixed ms per
    request); `boundary` holds the cut's tensors on a reference input."""
    bits_per_s, overhead_ms = link
    edge_ms = sum(t for n, t in edge_times.items() if n in cut.edge_nodes)
    server_ms = sum(t for n, t in server_times.items() if n not in cut.edge_nodes)
    if cut.kind == ALL_EDGE:
        return Prediction(cut, codec, edge_ms, 0.0, 0.0, 0, 0, 0)
    raw = sum(int(boundary[t].nbytes) for t in cut.tensors)
    wire = sum(codec.wire_bytes(boundary[t].shape, boundary[t].dtype) for t in cut.tensors)
    transfer = (wire + response_bytes) * 8 / bits_per_s * 1e3 + overhead_ms
    return Prediction(cut, codec, edge_ms, server_ms, transfer, raw, wire, response_bytes)
