"""Provenance: which original nodes, and which passes, every node came from.

Before the first pass every node is stamped `kiln.origin` = its own name. The onnxscript
rewriter copies metadata from matched nodes to their replacements; we register a merger that
takes the *union* of origins, so a fused node names every node it replaced. Passes that do not
go through the rewriter are covered by `track_pass`, which fills in what they left unstamped.

A model PyTorch exported (`torch.onnx.export(..., dynamo=True)`) also says where each node came
from in the user's code: the exporter's node metadata is turned into `kiln.module` (the module's
qualified name, `encoder.layer.3.attention.self.query`) and `kiln.source` (`file:line` of the
innermost frame outside PyTorch itself), merged through every pass the same way as origins.
"""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterable, Iterator
from pathlib import PurePath

import onnx_ir as ir

from kiln.ir.onnxscript_internals import register_metadata_merger

ORIGIN_KEY = "kiln.origin"
PASS_KEY = "kiln.pass"
MODULE_KEY = "kiln.module"
SOURCE_KEY = "kiln.source"
SEPARATOR = ","
SOURCE_SEPARATOR = "\n"  # a path may hold a comma
# What torch.onnx's exporter writes on each node (torch 2.5+).
TORCH_SCOPES = "pkg.torch.onnx.name_scopes"
TORCH_STACK = "pkg.torch.onnx.stack_trace"
TORCH_BULKY = (TORCH_STACK, "pkg.torch.onnx.fx_node")  # kept as kiln.source, then dropped
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_TRACE_BREAK = "\n--- merged by a rewrite ---\n"  # between the stack traces of fused nodes
_SITE_DIRS = {"site-packages", "dist-packages"}


def _union(first: str, second: str) -> str:
    return join_origins(split_origins(first) | split_origins(second))


def _union_sources(first: str, second: str) -> str:
    return SOURCE_SEPARATOR.join(sorted(_lines(first) | _lines(second)))


def _lines(text: str) -> set[str]:
    return {line for line in text.split(SOURCE_SEPARATOR) if line}


def _union_traces(first: str, second: str) -> str:
    traces = dict.fromkeys([*first.split(_TRACE_BREAK), *second.split(_TRACE_BREAK)])
    return _TRACE_BREAK.join(traces)


def split_origins(text: str) -> set[str]:
    return {part for part in text.split(SEPARATOR) if part}


def join_origins(origins: set[str]) -> str:
    return SEPARATOR.join(sorted(origins))


# The rewriter's own extension point for merging node metadata (one merger per key).
register_metadata_merger(ORIGIN_KEY, _union)
register_metadata_merger(PASS_KEY, _union)
register_metadata_merger(MODULE_KEY, _union)
register_metadata_merger(SOURCE_KEY, _union_sources)
# The exporter fuses too (a BatchNorm into its Conv): keep every fused node's scopes and stack.
register_metadata_merger(TORCH_SCOPES, _union_sources)
register_metadata_merger(TORCH_STACK, _union_traces)


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
    """Give every node a unique name and `kiln.origin` = that name; where PyTorch's exporter
    left its metadata, `kiln.module` and `kiln.source` too (see `stamp_trace`)."""
    seen: set[str] = set()
    for index, node in enumerate(all_nodes(model.graph)):
        name = node.name or f"{node.op_type}_{index}"
        while name in seen:
            name = f"{name}_{index}"
        seen.add(name)
        node.name = name
        node.metadata_props[ORIGIN_KEY] = name
        stamp_trace(node)


def stamp_trace(node: ir.Node) -> None:
    """`kiln.module` and `kiln.source` from torch.onnx's node metadata, when it has some and
    they are not set yet; the exporter's bulky stack trace and FX node text are then dropped."""
    props = node.metadata_props
    modules, sources = torch_trace(props)
    if modules and MODULE_KEY not in props:
        props[MODULE_KEY] = join_origins(modules)
    if sources and SOURCE_KEY not in props:
        props[SOURCE_KEY] = SOURCE_SEPARATOR.join(sorted(sources))
    for key in TORCH_BULKY:
        props.pop(key, None)


def torch_trace(props: dict[str, str]) -> tuple[set[str], set[str]]:
    """(qualified module names, `file:line`s in the user's code) from torch.onnx's metadata;
    more than one each where the exporter fused nodes.

    `name_scopes` lists the module path from the root to the op (`['', 'encoder',
    'encoder.layer.0', ..., 'linear']`): the module is the last entry before the op, none at
    the root. A stack trace runs outermost first: the source is its innermost frame that is
    not PyTorch's own code."""
    modules = set()
    for line in _lines(props.get(TORCH_SCOPES, "")):
        try:
            scopes = ast.literal_eval(line)
        except (ValueError, SyntaxError):
            continue
        if isinstance(scopes, list) and len(scopes) >= 2 and scopes[-2]:
            modules.add(str(scopes[-2]))
    sources = set()
    for trace in props.get(TORCH_STACK, "").split(_TRACE_BREAK):
        frames = _FRAME.findall(trace)
        user = [f"{file}:{line}" for file, line in frames if not _is_torch_internal(file)]
        sources.update(user[-1:])
    return modules, sources


def _is_torch_internal(file: str) -> bool:
    """PyTorch's own code (installed, or the loaded torch package), or no file at all."""
    if file.startswith("<"):
        return True
    parts = PurePath(file).parts
    installed = any(
        part == "torch" and index and parts[index - 1] in _SITE_DIRS
        for index, part in enumerate(parts)
    )
    torch = sys.modules.get("torch")
    home = getattr(torch, "__file__", None)
    return installed or bool(home and file.startswith(str(PurePath(home).parent) + "/"))


def trace_of(node: ir.Node) -> dict[str, list[str]]:
    """The modules and source lines behind a node ({} when the model says none): its
    `kiln.module` / `kiln.source`, or, for a model Kiln has not stamped, the exporter's own
    metadata."""
    props = node.metadata_props
    modules = split_origins(props.get(MODULE_KEY, ""))
    sources = _lines(props.get(SOURCE_KEY, ""))
    if not (modules or sources):
        modules, sources = torch_trace(props)
    found = {"module": sorted(modules), "source": sorted(sources)}
    return {key: value for key, value in found.items() if value}


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
        _inherit_trace(created, self.before.values())
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
        for meta in (ORIGIN_KEY, PASS_KEY, MODULE_KEY, SOURCE_KEY):
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
    _inherit_trace(created, old.values())
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


def _inherit_trace(created: list[ir.Node], known: Iterable[ir.Node]) -> None:
    """Modules and source lines for new nodes the rewriter did not merge them into: those of
    the nodes before the step that share an origin with them."""
    by_origin: dict[str, list[ir.Node]] = {}
    for node in known:
        for origin in origins_of(node):
            by_origin.setdefault(origin, []).append(node)
    for node in created:
        props = node.metadata_props
        if MODULE_KEY in props or SOURCE_KEY in props:
            continue
        kin = [other for origin in origins_of(node) for other in by_origin.get(origin, [])]
        traces = [trace_of(other) for other in kin]
        modules = {m for trace in traces for m in trace.get("module", [])}
        lines = {line for trace in traces for line in trace.get("source", [])}
        if modules:
            props[MODULE_KEY] = join_origins(modules)
        if lines:
            props[SOURCE_KEY] = SOURCE_SEPARATOR.join(sorted(lines))


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
