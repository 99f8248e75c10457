"""A `kiln profile` result as the debugger's panes use it: each kernel with the compiled nodes
and original nodes it runs (graph → operator → kernel), milliseconds per node on both panes,
the run's timeline, and the diagnosis findings with the nodes they are about.

A kernel that runs several nodes (a fusion the engine made) shares its time evenly among them,
as `kiln compare --model-explorer`'s latency overlay does.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from kiln.profile.finding import Finding

_KERNEL_FIELDS = (
    "key", "op_type", "kernel", "precision", "median_ms", "share", "graph_nodes", "original",
    "passes", "bound", "efficiency", "achieved_gflops", "roof_gflops", "intensity", "flops",
    "attributed_to",
)  # fmt: skip


def profile_view(result: dict[str, Any]) -> dict[str, Any]:
    """The parts of `kiln.profile.profile_model`'s result the page shows."""
    kernels = [_kernel(node) for node in result["nodes"]]
    by_key = {k["key"]: k for k in kernels}
    by_name = {k["name"]: k for k in kernels}
    return {
        "available": True,
        "engine": result["backend"]["name"],
        "latency": result["latency"],
        "kernels": kernels,
        "timeline": [_span(span, by_key) for span in result["timeline"]],
        "node_ms": {
            "compiled": _share(kernels, "graph_nodes"),
            "original": _share(kernels, "original"),
        },
        "findings": [_with_graph_nodes(f, by_name) for f in result["findings"]],
    }


def _kernel(node: dict[str, Any]) -> dict[str, Any]:
    kernel = {"name": node["node"]}
    kernel.update({key: node[key] for key in _KERNEL_FIELDS if key in node})
    kernel["original"] = list(node.get("original") or node.get("graph_nodes") or [])
    return kernel


def _span(span: dict[str, Any], by_key: dict[str, dict[str, Any]]) -> dict[str, Any]:
    kernel = by_key.get(span["key"], {})
    return {
        **span,
        "graph_nodes": kernel.get("graph_nodes", []),
        "original": kernel.get("original", []),
    }


def _share(kernels: list[dict[str, Any]], field: str) -> dict[str, float]:
    """Milliseconds per node: each kernel's median split evenly among the nodes it runs."""
    out: dict[str, float] = defaultdict(float)
    for kernel in kernels:
        nodes = kernel.get(field) or []
        for name in nodes:
            out[name] += kernel["median_ms"] / len(nodes)
    return dict(out)


def _with_graph_nodes(data: dict[str, Any], by_name: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A finding with the compiled and original nodes of the kernels it names."""
    finding = Finding.from_json(data)
    graph_nodes: list[str] = []
    original: list[str] = []
    for name in finding.nodes:
        kernel = by_name.get(name, {})
        graph_nodes += [n for n in kernel.get("graph_nodes", []) if n not in graph_nodes]
        original += [n for n in kernel.get("original", []) if n not in original]
    return {**data, "kernels": finding.nodes, "graph_nodes": graph_nodes, "original": original}
