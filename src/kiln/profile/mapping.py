"""From the engine's kernels back to the graph's nodes (and, for artifacts, the originals).

Engines rename what they fuse: ONNX Runtime runs `relu_nchwc` (Conv+BatchNorm+Relu in its
blocked layout) or `...scores.MatMul/MatMulScaleFusion/`, OpenVINO names the layers it fused.
A kernel is matched to the graph node whose name is the longest one contained in the kernel's
name; when that node's operator differs from the kernel's (the fused node took an activation's
name), the producers above it are added until the kernel's operator is reached. ONNX Runtime
names a kernel it re-lays out after the tensor the node computes (`<output>_nchwc`): where no
node name is found, the node computing the longest tensor name contained (or, for a short one,
leading) is taken. That is how an artifact's kernels are found, whose fused nodes have new
names (`node_FusedConv_0`) and keep the original tensors' names.

OpenVINO lists each kernel's original layers itself, by node name or by the name of the tensor
a node computes (its ONNX reader names layers after their outputs), sometimes with a suffix
(`fc/WithoutBiases`), and drops the ones a fusion replaced (Conv+BatchNorm+Relu lists the
BatchNorm and the Relu under a new `Multiply_4791`): the Conv is then found above them.
"""

from __future__ import annotations

import onnx_ir as ir

# Prefixes and spellings engines use for fused or re-laid-out versions of an operator.
_OP_PREFIXES = ("Fused", "Nchwc", "QLinear", "Dynamic")
_SAME_OP = {
    "Gemm": "MatMul",
    "FullyConnected": "MatMul",
    "FullyConnectedQuantizedLegacy": "MatMul",
    "FullyConnectedQuantized": "MatMul",
    "Convolution": "Conv",
    "GroupConvolution": "Conv",
}
# Operators a fusion is built around: a kernel of one of these that lists only its neighbours
# (BatchNorm, Relu) ran the one above them too.
_MAIN_OPS = {"Conv", "ConvTranspose", "MatMul"}
# Kernels engines insert to change a layout or an element type, never to compute a node.
LAYOUT_OPS = {"Reorder", "Convert", "Transpose", "ReorderInput", "ReorderOutput"}
# Quantization plumbing, and the activations a quantized kernel folds into its output range.
_FOLDED = {"QuantizeLinear", "DequantizeLinear", "Relu", "Clip"}
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
        self.model = model
        self.nodes = {node.name: node for node in model.graph if node.name}
        # Longest first, so the first substring hit is the most specific node.
        self._by_length = sorted(
            (n for n in self.nodes if len(n) >= _MIN_NAME), key=len, reverse=True
        )
        self._by_output = {
            value.name: node.name
            for node in self.nodes.values()
            for value in node.outputs
            if value.name
        }
        self._outputs_by_length = sorted(self._by_output, key=len, reverse=True)
        self._position = {name: i for i, name in enumerate(self.nodes)}  # graph order
        self._cache: dict[tuple[str, str], list[str]] = {}

    def match(self, kernel_name: str, op_type: str) -> list[str]:
        """Model node names a kernel ran; [] when the engine created it (layout reorders,
        its own fusions under new names)."""
        key = (kernel_name, op_type)
        if key not in self._cache:
            self._cache[key] = self._match(kernel_name, op_type)
        return self._cache[key]

    def resolve(self, name: str) -> str | None:
        """The node an engine's layer name stands for: a node's own name, the name of the
        tensor it computes, or either followed by `/suffix`; None for names the engine made
        up (Multiply_4791, Convert_442)."""
        for candidate in (name, name.split("/", 1)[0]):
            if candidate in self.nodes:
                return candidate
            if candidate in self._by_output:
                return self._by_output[candidate]
        return None

    def match_all(self, names: list[str], op_type: str) -> list[str]:
        """For engines (OpenVINO) that list the original layers of each kernel themselves:
        the nodes they name, in graph order, and the kernel's own operator above them when
        the engine's list lost it."""
        found = sorted(
            {node for name in names if (node := self.resolve(name)) is not None},
            key=self._position.__getitem__,
        )
        if not found:
            return []
        wanted = core_op(op_type)
        if wanted not in _MAIN_OPS or any(self._is(n, wanted) for n in found):
            return found
        node = self.nodes[found[0]]
        climbed: list[str] = []
        for _ in range(_MAX_WALK):
            producer = _first_producer(node)
            if producer is None or not producer.name:
                break
            node = producer
            climbed.insert(0, node.name)
            if self._is(node.name, wanted):
                return climbed + found
        return found

    def _is(self, name: str, wanted: str) -> bool:
        return core_op(self.nodes[name].op_type) == wanted

    def _match(self, kernel_name: str, op_type: str) -> list[str]:
        name = kernel_name if kernel_name in self.nodes else None
        if name is None:
            name = next((n for n in self._by_length if n in kernel_name), None)
        if name is None and op_type not in LAYOUT_OPS:  # a layout change computes no node
            output = next((t for t in self._outputs_by_length if _names(kernel_name, t)), None)
            name = self._by_output[output] if output is not None else None
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


def _names(kernel_name: str, tensor: str) -> bool:
    """Whether a kernel's name is made from a tensor's: containing it, or for a name too
    short to be found by chance (`y`), starting with it (`y_nchwc`)."""
    if len(tensor) >= _MIN_NAME:
        return tensor in kernel_name
    return kernel_name.startswith(f"{tensor}_")


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


def absorb_unnamed(groups: list[list[str]], model: ir.Model, op_types: list[str]) -> None:
    """Give a graph node no kernel names to the kernel that runs its neighbours, in place:
    engines fuse a weight's DequantizeLinear, or the Relu and QuantizeLinear after a Conv,
    without listing them. Taken: a node whose neighbours all belong to one kernel, and
    quantization plumbing next to one kernel and to nodes no kernel names. A node between
    two kernels (a Flatten between a pool and a Gemm) stays with neither, and so does a node
    of an operator that a kernel naming no node runs (`op_types`: each kernel's): that
    kernel is the node's own (`claim_unowned`), as the second of two fused Convs is."""
    owner = {name: i for i, group in enumerate(groups) for name in group}
    nameless = [op for group, op in zip(groups, op_types, strict=True) if not group]
    spare = {core_op(op) for op in nameless if op not in LAYOUT_OPS}
    changed = True
    while changed:
        changed = False
        for node in model.graph:
            if not node.name or node.name in owner or core_op(node.op_type) in spare:
                continue
            around = [m for m in _neighbours(node) if m.op_type != "Constant"]
            kernels = {owner[m.name] for m in around if m.name in owner}
            inside = all(m.name in owner for m in around)
            if len(kernels) == 1 and (inside or node.op_type in _FOLDED):
                (kernel,) = kernels
                groups[kernel].append(node.name)
                owner[node.name] = kernel
                changed = True


def _neighbours(node: ir.Node) -> list[ir.Node]:
    return [*_producers(node), *_consumers(node)]


def claim_unowned(groups: list[list[str]], model: ir.Model, layout: list[bool]) -> None:
    """Give the kernels that name no graph node (OpenVINO's MVN_8232 for a LayerNorm written
    out op by op, ShapeOf_12371 for shape arithmetic) the nodes no kernel names, in place.
    `groups` are the kernels' graph nodes in execution order. Each connected run of such
    nodes goes to the nameless kernel that executes after every kernel feeding it and last
    before the kernels reading it. Kernels flagged in `layout` (the Reorders, Converts and
    Transposes an engine inserts) compute no graph node and are given none."""
    owner = {name: i for i, group in enumerate(groups) for name in group}
    nameless = [i for i, group in enumerate(groups) if not group and not layout[i]]
    if not nameless:
        return
    free = [n for n in model.graph if n.name and n.name not in owner]
    free_names = {n.name for n in free}
    seen: set[str] = set()
    for start in free:
        if start.name in seen:
            continue
        component = _component(start, free_names)
        seen.update(n.name for n in component)
        feeds = [owner[p.name] for n in component for p in _producers(n) if p.name in owner]
        reads = [owner[c.name] for n in component for c in _consumers(n) if c.name in owner]
        after, before = max(feeds, default=-1), min(reads, default=len(groups))
        between = [k for k in nameless if after < k < before]
        if between:  # the one nearest its readers, a kernel not yet given nodes first
            kernel = next((k for k in reversed(between) if not groups[k]), between[-1])
            groups[kernel].extend(n.name for n in component)


def _component(start: ir.Node, free: set[str]) -> list[ir.Node]:
    """The nodes connected to `start` through nodes in `free`."""
    found, stack = {start.name: start}, [start]
    while stack:
        for other in _neighbours(stack.pop()):
            if other.name in free and other.name not in found:
                found[other.name] = other
                stack.append(other)
    return list(found.values())


def _producers(node: ir.Node) -> list[ir.Node]:
    return [p for v in node.inputs if v is not None and (p := v.producer()) is not None]


def _consumers(node: ir.Node) -> list[ir.Node]:
    return [user for v in node.outputs for user, _ in v.uses()]
