"""Per-node and per-operator-type figures from the engine's per-kernel records."""

from __future__ import annotations

import dataclasses
import statistics
from collections import defaultdict
from typing import Any

from kiln.backends.base import KernelRecord
from kiln.profile.mapping import NodeMatcher, originals
from kiln.profile.roofline import precision_of


def record_json(record: KernelRecord) -> dict[str, Any]:
    """A kernel record as the profile result's "records" hold it (and `timeline` and
    kiln.report read it): the fields the engine filled, unset optional ones left out."""
    data = dataclasses.asdict(record)
    if record.origin is not None:
        data["origin"] = list(record.origin)
    return {k: v for k, v in data.items() if v is not None}


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
    share of the kernel total, and the graph nodes (and original nodes) behind it."""
    runs = sorted({r.run for r in records})
    per_run: dict[str, dict[int, float]] = defaultdict(lambda: defaultdict(float))
    first: dict[str, KernelRecord] = {}
    calls: dict[str, int] = defaultdict(int)
    for record in records:
        per_run[record.node][record.run] += record.dur_us / 1e3
        first.setdefault(record.node, record)
        calls[record.node] += 1
    nodes = []
    for name, times in per_run.items():
        record = first[name]
        values = [times.get(run, 0.0) for run in runs]
        if record.origin is not None:  # the engine names the layers it fused itself
            graph_nodes = matcher.match_all(list(record.origin), record.op_type)
        else:
            graph_nodes = matcher.match(name, record.op_type)
        original, passes = originals(graph_nodes, provenance)
        nodes.append(
            {
                "node": name,
                "op_type": record.op_type,
                "kernel": record.provider,
                "precision": precision_of(record.op_type, record.provider),
                "calls_per_run": calls[name] / max(len(runs), 1),
                "mean_ms": statistics.fmean(values),
                # the median is the figure ranked and placed on the roofline: one run
                # disturbed by another process must not make a kernel look slow
                "median_ms": statistics.median(values),
                "graph_nodes": graph_nodes,
                "original": original,
                "passes": passes,
            }
        )
    total = sum(n["median_ms"] for n in nodes)
    for node in nodes:
        node["share"] = node["median_ms"] / total if total > 0 else 0.0
    nodes.sort(key=lambda n: n["median_ms"], reverse=True)
    return nodes


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


def attach_costs(nodes: list[dict[str, Any]], costs: dict[str, Any]) -> None:
    """FLOPs and bytes of a kernel: the sum over the graph nodes it ran (bytes so summed are
    an upper bound for a fused kernel, whose intermediates never reach memory)."""
    for node in nodes:
        found = [costs[n] for n in node["graph_nodes"] if n in costs]
        # A node the cost model has no formula for would make the sum look cheap.
        if found and all(getattr(c, "known", True) for c in found):
            node["flops"] = float(sum(c.flops for c in found))
            node["bytes"] = float(sum(c.bytes for c in found))
            # The cost model knows quantized graph nodes; the kernel name knows the rest.
            lower = {getattr(c, "precision", "fp32") for c in found if c.flops} - {"fp32"}
            if node["precision"] == "fp32" and lower:
                node["precision"] = "int8" if "int8" in lower else sorted(lower)[0]


def timeline(records: list[dict[str, Any]], run: int) -> list[dict[str, Any]]:
    """One run's kernels as spans (start and duration in µs from the run's start), from the
    records in their JSON form (`record_json`, the result's "records"). Engines without start
    times (OpenVINO's counters) are laid end to end in execution order."""
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
        {"node": r["node"], "op_type": r["op_type"], "start_us": s, "dur_us": r["dur_us"]}
        for r, s in zip(mine, starts, strict=True)
    ]
