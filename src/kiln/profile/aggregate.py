"""Per-node and per-operator-type figures from the engine's per-kernel records."""

from __future__ import annotations

import dataclasses
import statistics
from collections import defaultdict
from typing import Any

from kiln.backends.base import KernelRecord
from kiln.ir.provenance import all_nodes, trace_of
from kiln.profile.mapping import (
    LAYOUT_OPS,
    NodeMatcher,
    absorb_unnamed,
    claim_unowned,
    core_op,
    originals,
)
from kiln.profile.roofline import precision_of
from kiln.profile.traffic import Traffic


def record_json(record: KernelRecord) -> dict[str, Any]:
    """A kernel record as the profile result's "records" hold it (and `timeline` and
    kiln.report read it): the fields the engine filled, unset optional ones left out."""
    data = dataclasses.asdict(record)
    if record.origin is not None:
        data["origin"] = list(record.origin)
    return {k: v for k, v in data.items() if v is not None}


def record_key(record: KernelRecord | dict[str, Any]) -> str:
    """What names one kernel in every profiled run: its place in the engine's execution order
    where the engine reports one (OpenVINO names the layers it creates anew at every compile,
    and each profiling round compiles), else the engine's name for it."""
    if isinstance(record, dict):
        order, name = record.get("order"), record["node"]
    else:
        order, name = getattr(record, "order", None), record.node
    return f"#{order}" if order is not None else name


def run_totals(records: list[KernelRecord]) -> list[float]:
    """Sum of all kernel times of each profiled run, in ms."""
    totals: dict[int, float] = defaultdict(float)
    for record in records:
        totals[record.run] += record.dur_us / 1e3
    return [totals[run] for run in sorted(totals)]


def per_node(
    records: list[KernelRecord],
    matcher: NodeMatcher,
    provenance: dict[str, dict] | None,
) -> list[dict[str, Any]]:
    """One entry per kernel the engine ran, slowest first: time per run (mean and median),
    share of the kernel total, and the graph nodes (and original nodes) behind it.

    A kernel that runs no graph node the engine names (a layout Reorder or a Transpose into
    NHWC it inserted, an op it made up under a new name) is attributed to the original nodes
    of the next kernel that does (`attributed_to`), with no FLOPs of its own."""
    runs = sorted({r.run for r in records})
    per_run: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    first: dict[str, KernelRecord] = {}
    calls: dict[str, int] = defaultdict(int)
    for record in records:
        key = record_key(record)
        per_run[key][record.run] += record.dur_us / 1e3
        first.setdefault(key, record)
        calls[key] += 1
    position = _positions(records)
    keys = sorted(per_run, key=position.__getitem__)
    groups = [_graph_nodes(first[key], matcher) for key in keys]
    traces = _traces(matcher, provenance)
    op_types = [first[key].op_type for key in keys]
    absorb_unnamed(groups, matcher.model, op_types)
    claim_unowned(groups, matcher.model, [op in LAYOUT_OPS for op in op_types])
    nodes = []
    for key, graph_nodes in zip(keys, groups, strict=True):
        record, times = first[key], per_run[key]
        values = [times.get(run, 0.0) for run in runs]
        original, passes = originals(graph_nodes, provenance)
        engine_precision = getattr(record, "precision", None)
        entry = {
            "node": _display_name(record, graph_nodes, matcher),
            "key": key,
            "order": position[key],
            "op_type": record.op_type,
            "kernel": record.provider,
            "precision": engine_precision or precision_of(record.op_type, record.provider),
            # read back from the engine, not guessed from the kernel's name
            "precision_from": "engine" if engine_precision else "name",
            "calls_per_run": calls[key] / max(len(runs), 1),
            "mean_ms": statistics.fmean(values),
            # the median is the figure ranked and placed on the roofline: one run
            # disturbed by another process must not make a kernel look slow
            "median_ms": statistics.median(values),
            "graph_nodes": graph_nodes,
            "original": original,
            "passes": passes,
            # a PyTorch source's modules and file:line behind the kernel
            "module": sorted({m for n in graph_nodes for m in traces.get(n, {}).get("module", [])}),
            "source": sorted({s for n in graph_nodes for s in traces.get(n, {}).get("source", [])}),
        }
        engine_bytes = getattr(record, "bytes", None)
        if engine_bytes is not None:  # at the element types the kernel ran with
            entry["bytes"], entry["bytes_from"] = float(engine_bytes), "engine"
        nodes.append(entry)
    _unique_names(nodes)
    _attribute_unmapped(nodes)
    total = sum(n["median_ms"] for n in nodes)
    for node in nodes:
        node["share"] = node["median_ms"] / total if total > 0 else 0.0
    nodes.sort(key=lambda n: n["median_ms"], reverse=True)
    return nodes


def _traces(matcher: NodeMatcher, provenance: dict[str, dict] | None) -> dict[str, dict]:
    """Graph node → its modules and source lines: an artifact's provenance, or an original's
    own node metadata."""
    if provenance is not None:
        return provenance
    return {node.name or "": trace_of(node) for node in all_nodes(matcher.model.graph)}


def _positions(records: list[KernelRecord]) -> dict[str, int]:
    """Each kernel's place in execution order: the engine's where it reports one, else its
    rank by start time (or record order) within the run it first appears in."""
    by_run: dict[int, list[KernelRecord]] = defaultdict(list)
    for record in records:
        by_run[record.run].append(record)
    out: dict[str, int] = {}
    for run in sorted(by_run):
        mine = by_run[run]
        if all(r.ts_us is not None for r in mine):
            mine = sorted(mine, key=lambda r: r.ts_us or 0.0)
        for rank, record in enumerate(mine):
            order = getattr(record, "order", None)
            out.setdefault(record_key(record), order if order is not None else rank)
    return out


def _graph_nodes(record: KernelRecord, matcher: NodeMatcher) -> list[str]:
    if record.origin is not None:  # the engine names the layers it fused itself
        return matcher.match_all(list(record.origin), record.op_type)
    return list(matcher.match(record.node, record.op_type))


def _display_name(record: KernelRecord, graph_nodes: list[str], matcher: NodeMatcher) -> str:
    """The engine's name when it names a graph node or stays put; else (OpenVINO's
    Multiply_4791, renamed at every compile) the graph node the kernel is built around."""
    if getattr(record, "order", None) is None or matcher.resolve(record.node) or not graph_nodes:
        return record.node
    wanted = core_op(record.op_type)
    main = [n for n in graph_nodes if core_op(matcher.nodes[n].op_type) == wanted]
    return (main or graph_nodes)[0]


def _unique_names(nodes: list[dict[str, Any]]) -> None:
    seen: dict[str, int] = defaultdict(int)
    for node in nodes:
        seen[node["node"]] += 1
    for node in nodes:
        if seen[node["node"]] > 1:
            node["node"] = f"{node['node']} {node['key']}"


def _attribute_unmapped(nodes: list[dict[str, Any]]) -> None:
    """Kernels that ran no graph node take the originals of the next kernel that did (the
    previous one at the end of the run): engines insert layout changes for the kernel that
    reads them."""
    mapped = [n for n in nodes if n["graph_nodes"]]  # in execution order
    for node in nodes:
        if node["graph_nodes"] or not mapped:
            continue
        later = [n for n in mapped if n["order"] > node["order"]]
        target = later[0] if later else mapped[-1]
        node["attributed_to"] = target["node"]
        node["original"], node["passes"] = list(target["original"]), list(target["passes"])
        node["module"], node["source"] = list(target["module"]), list(target["source"])


def per_op_type(nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Kernels grouped by the engine's operator type, slowest first."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for node in nodes:
        groups[node["op_type"]].append(node)
    out = []
    for op_type, members in groups.items():
        flops = [n["flops"] for n in members if n.get("flops") is not None]
        median = sum(n["median_ms"] for n in members)
        out.append(
            {
                "op_type": op_type,
                "kernels": len(members),
                "mean_ms": sum(n["mean_ms"] for n in members),
                "median_ms": median,
                "share": sum(n["share"] for n in members),
                "flops": sum(flops) if flops else None,
                "achieved_gflops": sum(flops) / (median * 1e6) if flops and median > 0 else None,
            }
        )
    out.sort(key=lambda o: o["median_ms"], reverse=True)
    return out


def attach_costs(
    nodes: list[dict[str, Any]], costs: dict[str, Any], traffic: Traffic | None = None
) -> None:
    """FLOPs and bytes of each kernel. FLOPs: the sum over the graph nodes it ran, each node
    counted once (a Conv+BatchNorm+Relu kernel has the Conv's FLOPs and the others'). Bytes:
    the engine's figure where it gives one (at the types it ran with), else the nodes'
    boundary traffic (`Traffic`), else the sum of their bytes."""
    claimed: set[str] = set()
    for node in sorted(nodes, key=lambda n: n["order"]):
        from_engine = node.get("bytes_from") == "engine"
        if node.get("attributed_to") is not None:
            # moves data for another kernel and computes nothing of the graph's
            if from_engine:
                node["flops"] = 0.0
            continue
        mine = [n for n in node["graph_nodes"] if n in costs and n not in claimed]
        claimed.update(mine)
        found = [costs[n] for n in mine]
        # A node the cost model has no formula for would make the sum look cheap.
        if not found or not all(getattr(c, "known", True) for c in found):
            continue
        node["flops"] = float(sum(c.flops for c in found))
        if not from_engine:
            together = traffic.bytes(mine, costs) if traffic else sum(c.bytes for c in found)
            node["bytes"], node["bytes_from"] = float(together), "graph"
        if node["precision_from"] == "engine":
            continue
        # The cost model knows quantized graph nodes; the kernel name knows the rest.
        lower = {getattr(c, "precision", "fp32") for c in found if c.flops} - {"fp32"}
        if node["precision"] == "fp32" and lower:
            node["precision"] = "int8" if "int8" in lower else sorted(lower)[0]


def timeline(
    records: list[dict[str, Any]], run: int, names: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """One run's kernels as spans (start and duration in µs from the run's start), from the
    records in their JSON form (`record_json`, the result's "records"). Engines without start
    times (OpenVINO's counters) are laid end to end in execution order. `names` (kernel key →
    the per-kernel entry's name) names the spans as the per-kernel table does."""
    names = names or {}
    mine = [r for r in records if r["run"] == run]
    if mine and all("ts_us" in r for r in mine):
        mine.sort(key=lambda r: r["ts_us"])
        origin = mine[0]["ts_us"]
        starts = [r["ts_us"] - origin for r in mine]
    else:
        starts, clock = [], 0.0
        for record in mine:
            starts.append(clock)
            clock += record["dur_us"]
    return [
        {
            "node": names.get(record_key(r), r["node"]),
            "key": record_key(r),
            "op_type": r["op_type"],
            "start_us": s,
            "dur_us": r["dur_us"],
        }
        for r, s in zip(mine, starts, strict=True)
    ]
