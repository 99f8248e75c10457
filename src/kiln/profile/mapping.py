"""From the engine's kernels back to the graph's nodes (and, for artifacts, the originals).

Engines rename what they fuse: ONNX Runtime runs `relu_nchwc` (Conv+BatchNorm+Relu in its
blocked layout) or `...scores.MatMul/MatMulScaleFusion/`, OpenVINO names the layers it fused.
A kernel is matched to the graph node whose name is the longest one contained in the kernel's
name; when that node's operator differs from the kernel's (the fused node took an activation's
name), the producers above it are added until the kernel's operator is reached.
"""

from __future__ import annotations

import onnx_ir as ir

# Prefixes and spellings engines use for fused or re-laid-out versions of an operator.
_OP_PREFIXES = ("Fused", "Nchwc", "QLinear", "Dynamic")
_SAME_OP = {"Gemm": "MatMul", "FullyConnected": "MatMul", "Convolution": "Conv"}
_MIN_NAME = 3  # shorter node names match too much by accident
_MAX_WALK = 3  # producers to climb (Conv ← BatchNorm ← Relu is 2)


def core_op(op_type: str) -> str:
    """The plain ONNX operator behind an engine's op name (FusedMatMul → MatMul)."""
    for prefix in _OP_PREFIXES:
        if op_type.startswith(prefix) and len(op_type) > len(prefix):
            op_type = op_type[len(prefix) :]
    return _SAME_OP.get(op_type, op_type)


class NodeMatcher:
    """Matches engine kernel names to the model's node names."""

    def __init__(self, model: ir.Model) -> None:
        self.nodes = {node.name: node for node in model.graph if node.name}
        # Longest first, so the first substring hit is the most specific node.
        self._by_length = sorted(
            (n for n in self.nodes if len(n) >= _MIN_NAME), key=len, reverse=True
        )
        self._cache: dict[tuple[str, str], list[str]] = {}

    def match(self, kernel_name: str, op_type: str) -> list[str]:
        """Model node names a kernel ran; [] when the engine created it (layout reorders,
        its own fusions under new names)."""
        key = (kernel_name, op_type)
        if key not in self._cache:
            self._cache[key] = self._match(kernel_name, op_type)
        return self._cache[key]

    def match_all(self, names: list[str], op_type: str) -> list[str]:
        """For engines (OpenVINO) that list the original layers of each kernel themselves."""
        found: list[str] = []
        for name in names:
            for node in self.match(name, op_type if len(names) == 1 else ""):
                if node not in found:
                    found.append(node)
        return found

    def _match(self, kernel_name: str, op_type: str) -> list[str]:
        name = kernel_name if kernel_name in self.nodes else None
        if name is None:
            name = next((n for n in self._by_length if n in kernel_name), None)
        if name is None:
            return []
        chain = [name]
        wanted = core_op(op_type)
        node = self.nodes[name]
        for _ in range(_MAX_WALK):
            if not wanted or core_op(node.op_type) == wanted:
                return chain
            producer = _first_producer(node)
            if producer is None or not producer.name:
                break
            node = producer
            chain.insert(0, node.name)
        # The kernel's operator was not found above: trust the name alone.
        return chain if core_op(node.op_type) == wanted else [name]


def _first_producer(node: ir.Node) -> ir.Node | None:
    """The node computing the data input (the first non-constant one)."""
    for value in node.inputs:
        if value is not None and value.producer() is not None:
            return value.producer()
    return None


def originals(
    model_nodes: list[str], provenance: dict[str, dict] | None
) -> tuple[list[str], list[str]]:
    """(original node names, passes) behind compiled nodes; an original model is its own."""
    if provenance is None:
        return list(model_nodes), []
    names: set[str] = set()
    passes: set[str] = set()
    for node in model_nodes:
        entry = provenance.get(node, {})
        names.update(entry.get("origin") or [node])
        passes.update(entry.get("passes") or [])
    return sorted(names), sorted(passes)
