"""Bytes a kernel moves when the engine does not say: what crosses its boundary, at the size
the engine keeps it.

The cost model counts every node's inputs and outputs at their graph types. A fused kernel
never writes the tensors that stay inside it, nor reads them back; and an integer kernel built
from a QDQ graph (DequantizeLinear → Conv → Relu → QuantizeLinear) reads and writes the 8-bit
tensors, not the fp32 ones the graph shows between its Q and DQ nodes.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

import onnx
from onnx import TensorProto

from kiln.cost import NodeCost
from kiln.cost.shapes import Tensors

_EIGHT_BIT = (TensorProto.INT8, TensorProto.UINT8)
# Between a kernel and its QuantizeLinear, these fold into the quantized range.
_RANGE_OPS = {"Relu", "Clip"}


class Traffic:
    """Boundary bytes of groups of nodes of one model (named as `kiln.cost.node_costs` keys)."""

    def __init__(self, model: onnx.ModelProto, tensors: Tensors) -> None:
        self.tensors = tensors
        self.nodes = {n.name or f"#{i}:{n.op_type}": n for i, n in enumerate(model.graph.node)}
        self.readers: dict[str, list[str]] = defaultdict(list)
        self.writer: dict[str, str] = {}
        for key, node in self.nodes.items():
            for name in node.input:
                if name:
                    self.readers[name].append(key)
            for name in node.output:
                self.writer[name] = key
        self.graph_outputs = {v.name for v in model.graph.output}

    def bytes(self, group: list[str], costs: Mapping[str, NodeCost]) -> int:
        """The group's bytes: the sum of its nodes' less the tensors that stay inside it,
        with 8-bit tensors of a QDQ graph counted at one byte per element."""
        members = {name for name in group if name in self.nodes}
        total = sum(costs[name].bytes for name in members if name in costs)
        for name in members:
            node = self.nodes[name]
            for tensor in filter(None, node.output):
                readers = self.readers.get(tensor, [])
                inside = sum(1 for r in readers if r in members)
                size = self.tensors.nbytes(tensor) or 0
                total -= size * inside  # read from registers or cache, not memory
                if inside == len(readers) and tensor not in self.graph_outputs:
                    total -= size  # never written out
                elif self._requantized(tensor):
                    total -= self._narrowing(tensor)
            for tensor in filter(None, node.input):
                if self.writer.get(tensor) not in members and self._dequantized(tensor):
                    total -= self._narrowing(tensor)
        return max(total, 0)

    def _dequantized(self, tensor: str) -> bool:
        """A DequantizeLinear's output: the engine reads the 8-bit tensor behind it."""
        return self.tensors.dequantized.get(tensor) in _EIGHT_BIT

    def _requantized(self, tensor: str, depth: int = 1) -> bool:
        """Read only by QuantizeLinear nodes (or through a Relu/Clip): written in 8 bits."""
        readers = [self.nodes[r] for r in self.readers.get(tensor, [])]
        return bool(readers) and all(
            reader.op_type == "QuantizeLinear"
            or (
                reader.op_type in _RANGE_OPS
                and depth > 0
                and len(reader.output) > 0
                and self._requantized(reader.output[0], depth - 1)
            )
            for reader in readers
        )

    def _narrowing(self, tensor: str) -> int:
        """Bytes saved by holding `tensor` in 8 bits rather than at its graph type."""
        count, size = self.tensors.numel_or_none(tensor), self.tensors.itemsize(tensor)
        if count is None or size is None or size <= 1:
            return 0
        return int(count * (size - 1))
