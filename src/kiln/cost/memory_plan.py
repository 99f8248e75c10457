"""The activation memory a model needs, from tensor lifetimes alone (the model is never run).

Nodes execute in the order the main graph lists them (ONNX requires that order to be
topological). Each intermediate tensor lives from the node that produces it to the last node
that reads it, both included: while a node runs, its inputs and outputs are held together
(no in-place reuse is assumed). A graph output lives to the last node; a tensor nobody reads
lives only while its producer runs.

* **Live peak**: the most bytes alive at any one step, the floor any planner reaches without
  recomputing tensors or working in place, with the tensors alive there and their producers.
* **Greedy-by-size arena**: tensors sorted by size (largest first) and each placed at the
  lowest offset where it overlaps no placed tensor in both time and space, as TFLite Micro's
  ``GreedyMemoryPlanner`` places them (Pisarchyk & Lee, 2020, "Efficient Memory Management for
  Deep Neural Net Inference"); offsets and sizes are aligned to ``alignment`` bytes (TFLite's
  64). Its arena is at least the live peak, and usually within a few percent of it.
* **Live bytes per step**, for a memory-over-time chart.

Graph inputs and weights (initializers and Constant nodes, which engines fold into weights)
are counted apart, never in the arena. Shapes and element types come from
:mod:`kiln.cost.shapes` with symbolic dims fixed by ``dims`` (else the model's ``kiln.dims``
metadata); a tensor whose size stays unknown is left out and named in ``unknown``, never
guessed. Control flow (If/Loop/Scan): only the node's own outputs are counted, not what its
bodies allocate; a main-graph tensor a body reads stays alive until that node runs.

This plans the graph as given; an engine runs its own rewrite of it (fusions, in-place
kernels, prepacked weights), so its arena can land below or above these figures.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import onnx
import onnx_ir as ir

from kiln.cost.shapes import Tensors, known_tensors, resolve_dims

MIB = 2**20
TFLITE_ALIGNMENT = 64  # bytes; TFLite's kDefaultTensorAlignment
_WEIGHT_OPS = {"Constant"}  # outputs engines fold into weights, not activations


@dataclass(frozen=True)
class TensorLife:
    """One intermediate tensor: its size and the steps (node indices) it is alive for."""

    name: str
    bytes: int
    first: int  # the producing node's index
    last: int  # the last reader's index (the last node for a graph output)
    producer: str  # the producing node's name
    op_type: str  # ... and its op type

    def alive_at(self, step: int) -> bool:
        return self.first <= step <= self.last


@dataclass(frozen=True)
class MemoryPlan:
    """Lifetimes, live peak and greedy-by-size arena of one graph (see the module docstring)."""

    nodes: tuple[str, ...]  # execution order: node names (``#index:OpType`` when unnamed)
    op_types: tuple[str, ...]
    tensors: tuple[TensorLife, ...]  # intermediates of known size, in production order
    offsets: tuple[int, ...]  # greedy-by-size offset of each of `tensors`
    live_bytes: tuple[int, ...]  # bytes alive while each node runs
    greedy_arena_bytes: int
    weights_bytes: int  # initializers and Constant nodes
    inputs_bytes: int  # graph inputs (fed by the caller)
    unknown: tuple[str, ...]  # intermediates of unknown size: not counted anywhere
    control_flow: int  # If/Loop/Scan nodes, whose bodies' own tensors are not counted
    alignment: int = TFLITE_ALIGNMENT

    @property
    def live_peak_bytes(self) -> int:
        return max(self.live_bytes, default=0)

    @property
    def peak_step(self) -> int:
        """The first step at which the live peak is reached (-1 for a graph with no nodes)."""
        if not self.live_bytes:
            return -1
        return self.live_bytes.index(self.live_peak_bytes)

    @property
    def at_peak(self) -> tuple[TensorLife, ...]:
        """The tensors alive at the peak, largest first."""
        step = self.peak_step
        alive = [t for t in self.tensors if t.alive_at(step)]
        return tuple(sorted(alive, key=lambda t: (-t.bytes, t.first)))

    @property
    def no_reuse_bytes(self) -> int:
        """Every intermediate in a buffer of its own: what no planning at all costs."""
        return sum(t.bytes for t in self.tensors)

    def to_json(self, top: int = 10) -> dict:
        """JSON-ready figures; the peak's tensors are the ``top`` largest of those alive."""
        step, alive = self.peak_step, self.at_peak
        return {
            "live_peak_mib": self.live_peak_bytes / MIB,
            "greedy_arena_mib": self.greedy_arena_bytes / MIB,
            "no_reuse_mib": self.no_reuse_bytes / MIB,
            "weights_mib": self.weights_bytes / MIB,
            "inputs_mib": self.inputs_bytes / MIB,
            "live_peak_bytes": self.live_peak_bytes,
            "greedy_arena_bytes": self.greedy_arena_bytes,
            "alignment": self.alignment,
            "tensors": len(self.tensors),
            "unknown": len(self.unknown),
            "unknown_tensors": list(self.unknown[:top]),
            "control_flow": self.control_flow,
            "peak": {
                "step": step,
                "node": self.nodes[step] if step >= 0 else None,
                "op_type": self.op_types[step] if step >= 0 else None,
                "tensors_alive": len(alive),
                "tensors": [_tensor_json(t) for t in alive[:top]],
            },
            "series": {
                "node": list(self.nodes),
                "op_type": list(self.op_types),
                "live_mib": [round(b / MIB, 6) for b in self.live_bytes],
            },
        }


def plan_memory(
    model: ir.Model | onnx.ModelProto,
    dims: Mapping[str, int] | None = None,
    *,
    tensors: Tensors | None = None,
    alignment: int = TFLITE_ALIGNMENT,
) -> MemoryPlan:
    """The memory plan of ``model``'s main graph (not mutated).

    ``dims`` fixes symbolic input dims, as for :func:`kiln.cost.node_costs`; ``tensors``, when
    the caller already inferred the shapes (for the same dims), saves inferring them again.
    Raises KilnError when a symbolic dim has no value or shape inference fails."""
    proto = ir.to_proto(model) if isinstance(model, ir.Model) else model
    if tensors is None:
        tensors = known_tensors(proto, resolve_dims(proto, dims))
    graph = proto.graph
    nodes = [node.name or f"#{i}:{node.op_type}" for i, node in enumerate(graph.node)]
    lives, unknown = _lifetimes(graph, nodes, tensors)
    live = _live_bytes(lives, len(nodes))
    offsets, arena = greedy_by_size(lives, alignment)
    return MemoryPlan(
        nodes=tuple(nodes),
        op_types=tuple(node.op_type for node in graph.node),
        tensors=tuple(lives),
        offsets=tuple(offsets),
        live_bytes=tuple(live),
        greedy_arena_bytes=arena,
        weights_bytes=_weight_bytes(graph, tensors),
        inputs_bytes=_input_bytes(graph, tensors),
        unknown=tuple(unknown),
        control_flow=sum(1 for node in graph.node if any(_bodies(node))),
        alignment=alignment,
    )


def greedy_by_size(
    lives: list[TensorLife], alignment: int = TFLITE_ALIGNMENT
) -> tuple[list[int], int]:
    """Offsets (in the order of ``lives``) and the arena size the greedy-by-size planner reaches.

    Largest first (ties: the earlier-born first, as TFLite breaks them); each tensor takes the
    lowest aligned offset whose range overlaps no placed tensor that is alive at the same time.
    """
    order = sorted(range(len(lives)), key=lambda i: (-lives[i].bytes, lives[i].first))
    offsets = [0] * len(lives)
    placed: list[int] = []
    arena = 0
    for i in order:
        size = _align(lives[i].bytes, alignment)
        if size == 0:
            continue  # an empty tensor needs no room
        offsets[i] = _lowest_gap(lives, offsets, placed, i, size, alignment)
        placed.append(i)
        arena = max(arena, offsets[i] + size)
    return offsets, arena


def _lowest_gap(
    lives: list[TensorLife], offsets: list[int], placed: list[int], i: int, size: int, align: int
) -> int:
    """The lowest offset where ``size`` bytes fit between the placed tensors alive with ``i``."""
    me = lives[i]
    busy = sorted(
        (offsets[j], offsets[j] + _align(lives[j].bytes, align))
        for j in placed
        if lives[j].first <= me.last and me.first <= lives[j].last
    )
    offset = 0
    for start, end in busy:
        if offset + size <= start:
            break  # the gap before this one is large enough
        offset = max(offset, end)
    return offset


def _lifetimes(
    graph: onnx.GraphProto, nodes: list[str], tensors: Tensors
) -> tuple[list[TensorLife], list[str]]:
    """Each intermediate's [producer, last reader] in node indices; and those of unknown size."""
    born: dict[str, int] = {}
    for index, node in enumerate(graph.node):
        if node.op_type in _WEIGHT_OPS:
            continue
        for name in node.output:
            if name:
                born.setdefault(name, index)
    last = dict(born)
    for index, node in enumerate(graph.node):
        for name in _reads(node):
            if name in born:
                last[name] = max(last[name], index)
    end = len(graph.node) - 1
    for output in graph.output:
        if output.name in born:
            last[output.name] = end  # handed back to the caller after the last node
    lives, unknown = [], []
    for name, first in born.items():
        size = tensors.nbytes(name)
        if size is None:
            unknown.append(name)
            continue
        node = graph.node[first]
        lives.append(TensorLife(name, size, first, last[name], nodes[first], node.op_type))
    return lives, unknown


def _reads(node: onnx.NodeProto) -> Iterator[str]:
    """The names ``node`` reads: its inputs, and the outer tensors its bodies read (If/Loop/Scan
    bodies name outer-scope tensors directly, not through the node's inputs)."""
    yield from (name for name in node.input if name)
    for body in _bodies(node):
        for inner in body.node:
            yield from _reads(inner)
        yield from (output.name for output in body.output)


def _bodies(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


def _live_bytes(lives: list[TensorLife], steps: int) -> list[int]:
    """Bytes alive at each step (a difference array: +size at birth, -size after the last read)."""
    delta = [0] * (steps + 1)
    for t in lives:
        delta[t.first] += t.bytes
        delta[t.last + 1] -= t.bytes
    live, total = [], 0
    for change in delta[:steps]:
        total += change
        live.append(total)
    return live


def _weight_bytes(graph: onnx.GraphProto, tensors: Tensors) -> int:
    """Initializers (at their stored dtype) and Constant nodes' values."""
    names = [init.name for init in graph.initializer]
    names += [o for node in graph.node if node.op_type in _WEIGHT_OPS for o in node.output if o]
    return sum(tensors.nbytes(name) or 0 for name in dict.fromkeys(names))


def _input_bytes(graph: onnx.GraphProto, tensors: Tensors) -> int:
    weights = {init.name for init in graph.initializer}
    return sum(tensors.nbytes(vi.name) or 0 for vi in graph.input if vi.name not in weights)


def _align(size: int, alignment: int) -> int:
    return -(-size // alignment) * alignment if alignment > 1 else size


def _tensor_json(t: TensorLife) -> dict:
    return {
        "name": t.name,
        "bytes": t.bytes,
        "mib": t.bytes / MIB,
        "producer": t.producer,
        "op_type": t.op_type,
        "first": t.first,
        "last": t.last,
    }
