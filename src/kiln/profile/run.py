"""`profile_model`: measure, aggregate, place on the roofline, diagnose; one JSON-ready dict."""

from __future__ import annotations

import datetime as dt
import statistics
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import onnx
import onnx_ir as ir

from kiln import __version__
from kiln.artifact import Manifest
from kiln.errors import KilnError
from kiln.ir.inputs import feed_dims
from kiln.profile.aggregate import (
    attach_costs,
    per_node,
    per_op_type,
    record_json,
    run_totals,
    timeline,
)
from kiln.profile.diagnose import Context, diagnose, tried_precisions
from kiln.profile.mapping import NodeMatcher
from kiln.profile.measure import measure
from kiln.profile.roofline import mixed_peak, place, roofs
from kiln.profile.target import load_target, target_feeds
from kiln.profile.traffic import Traffic
from kiln.timing import stats

if TYPE_CHECKING:
    from kiln.cost.shapes import Tensors


def profile_model(
    source: str,
    *,
    backend: str | None = None,
    batch: int = 1,
    shapes: dict[str, tuple[int, ...]] | None = None,
    runs: int = 20,
    rounds: int = 5,
    peaks: Any = None,
    say: Callable[[str], None] = lambda _msg: None,
    feeds: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Profile a model (.onnx, zoo:NAME, a .pt2 program) or artifact (NAME.kiln) on a backend;
    on `feeds` if given, else on synthesized inputs fitted as `kiln optimize` fits them (see
    `target_feeds`).

    `peaks` (a `kiln.hardware.Peaks`) defaults to this machine's measured peaks.
    """
    if runs < 1 or rounds < 1:
        raise KilnError("--runs and --rounds must be 1 or more.")
    say(f"loading {source}")
    target = load_target(source, backend)
    feeds = feeds if feeds is not None else target_feeds(target, batch, shapes, say)
    if peaks is None:
        from kiln.hardware import measured_peaks

        peaks = measured_peaks(progress=lambda step: say(f"measuring this machine: {step}"))
    measured = measure(target, feeds, runs=runs, rounds=min(rounds, runs), say=say)
    say("aggregating and diagnosing")
    nodes = per_node(measured.records, NodeMatcher(target.model), target.provenance)
    proto, dims = ir.to_proto(target.model), feed_dims(target.model, feeds)
    tensors, shape_error = _known_tensors(proto, dims)  # for the costs and the memory plan
    cost_note = _attach_costs(nodes, proto, dims, tensors)
    for node in nodes:
        place(node, peaks)
    latency = stats(measured.latency_s, batch)
    totals = run_totals(measured.records)
    findings = diagnose(
        Context(
            nodes=nodes,
            model=target.model,
            source=_original_source(source, target.manifest),
            peaks=peaks,
            cpu_utilization=measured.cpu_utilization,
            cores=measured.cores,
            idle_fraction=measured.idle_fraction,
            tried=tried_precisions(target.manifest.benchmark if target.manifest else None),
        )
    )
    # The raw records leave as JSON (for --trace and kiln.report), in the shape they always had.
    records = [record_json(r) for r in measured.records]
    return {
        "kiln_version": __version__,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "source": source,
        "name": target.name,
        "artifact": target.is_artifact,
        "backend": {"name": target.backend, "options": target.options.to_json()},
        "batch": batch,
        "inputs": {k: list(v.shape) for k, v in feeds.items()},
        "latency": latency.to_json(),
        "node_time": _node_time(totals, latency.p50_ms, measured.profiled_ms),
        "roofline": _whole_model(nodes, latency.p50_ms, peaks, cost_note),
        "cpu_utilization": measured.cpu_utilization,
        "cores": measured.cores,
        "idle_fraction": measured.idle_fraction,
        "memory": measured.memory,
        "memory_plan": _memory_plan(proto, tensors, shape_error, measured.memory),
        "findings": [f.to_json() for f in findings],
        "nodes": nodes,
        "op_types": per_op_type(nodes),
        "timeline": _median_timeline(records, measured.records, totals, nodes),
        "records": records,
        "provenance": _provenance_view(nodes) if target.is_artifact else None,
        "manifest": _manifest_summary(target.manifest),
    }


def _node_time(totals: list[float], p50_ms: float, profiled_ms: list[float]) -> dict[str, Any]:
    """The per-node sums of the profiled runs against the end-to-end latency."""
    return {
        "profiled_runs": len(totals),
        "mean_ms": statistics.fmean(totals) if totals else 0.0,
        "median_ms": statistics.median(totals) if totals else 0.0,
        # the per-node sum of a run against the end-to-end latency measured without the
        # profiler (in the same alternating rounds, so under the same load)
        "ratio_to_p50": statistics.median(totals) / p50_ms if totals else 0.0,
        # ... and against the profiled runs' own end-to-end time: the profiler slows every
        # kernel, so this is the like-for-like coverage figure
        "profiled_p50_ms": _median(profiled_ms),
        "ratio_to_profiled": (
            statistics.median(totals) / _median(profiled_ms) if totals and profiled_ms else None
        ),
        "profiler_overhead": _median(profiled_ms) / p50_ms - 1 if profiled_ms else None,
    }


def _median_timeline(
    records: list[dict[str, Any]], raw: list[Any], totals: list[float], nodes: list[dict]
) -> list[dict[str, Any]]:
    """The timeline of the run whose node time is the median (none for a model with no
    nodes: output = input runs no kernel)."""
    runs_seen = sorted({r.run for r in raw})
    if not runs_seen:
        return []
    median_run = (
        sorted(range(len(totals)), key=lambda i: totals[i])[len(totals) // 2] if totals else 0
    )
    return timeline(records, runs_seen[median_run], {n["key"]: n["node"] for n in nodes})


def _known_tensors(proto: onnx.ModelProto, dims: dict[str, int]) -> tuple[Tensors | None, str]:
    """Every tensor's shape, inferred once for the cost model and the memory plan (it is the
    slow part of both); else None and why."""
    from kiln.cost.shapes import known_tensors, resolve_dims

    try:
        return known_tensors(proto, resolve_dims(proto, dims)), ""
    except KilnError as exc:
        return None, str(exc)


def _attach_costs(
    nodes: list[dict], proto: onnx.ModelProto, dims: dict[str, int], tensors: Tensors | None
) -> str | None:
    """FLOPs and bytes per kernel from kiln.cost; a model it cannot cost is still profiled."""
    from kiln.cost import node_costs

    try:
        costs = node_costs(proto, dims)
    except KilnError as exc:
        return f"no roofline: {exc}"
    # Boundary bytes are only needed for kernels whose engine does not report its own.
    needs_traffic = any(n.get("bytes_from") != "engine" for n in nodes if n["graph_nodes"])
    traffic = Traffic(proto, tensors) if needs_traffic and tensors is not None else None
    attach_costs(nodes, costs, traffic)
    return None


def _memory_plan(
    proto: onnx.ModelProto, tensors: Tensors | None, shape_error: str, memory: dict[str, Any]
) -> dict[str, Any]:
    """The activation floor from tensor lifetimes (kiln.cost), beside what the engine grew by.

    The measured figure is the RSS growth over the first run: activations and the engine's
    arena together (ONNX Runtime does not report its arena). `run_peak_growth_mib` is the
    growth to the highest RSS sampled while warming up and timing, which also catches memory
    freed before a run returned."""
    from kiln.cost.memory_plan import plan_memory

    if tensors is None:
        return {"note": f"no memory plan: {shape_error}"}
    plan = plan_memory(proto, tensors=tensors)
    notes = []
    if plan.unknown:
        notes.append(
            f"{len(plan.unknown)} tensor(s) of unknown shape not counted, e.g. " + plan.unknown[0]
        )
    if plan.control_flow:
        notes.append(
            f"{plan.control_flow} control-flow node(s): their bodies' own tensors are not counted"
        )
    return {
        **plan.to_json(top=10),
        "measured_peak_mib": memory["first_run_growth_mib"],
        "run_peak_growth_mib": memory["model_peak_mib"] - memory["after_compile_mib"],
        "note": "; ".join(notes) or None,
    }


def _whole_model(nodes: list[dict], p50_ms: float, peaks: Any, note: str | None) -> dict:
    """Achieved GFLOP/s against the peak, and the fraction of the roofline: the time the
    roofline allows for all the work (kernel by kernel) over the end-to-end P50.

    The peak is that of the precisions the kernels ran in, weighted by their FLOPs (the
    harmonic mean: the time all the FLOPs would take, each at its own precision's peak): an
    int8 model is measured against the int8 peak, not the fp32 one."""
    costed = [n for n in nodes if n.get("flops") is not None]
    flops = sum(n["flops"] for n in costed)
    floor_ms = sum(n.get("roofline_ms", 0.0) for n in costed)
    node_ms = sum(n["median_ms"] for n in nodes)
    peak, precision = mixed_peak(costed, peaks)
    achieved = flops / (p50_ms * 1e6) if p50_ms > 0 else 0.0
    return {
        "peaks": peaks.to_json(),
        "roofs": roofs(peaks),
        "flops": flops,
        "bytes": sum(n.get("bytes") or 0.0 for n in costed),
        "achieved_gflops": achieved,
        "peak_gflops": peak,
        "peak_precision": precision,
        "fraction_of_peak": achieved / peak if peak else 0.0,
        "roofline_ms": floor_ms,
        "fraction_of_roofline": floor_ms / p50_ms if p50_ms > 0 else 0.0,
        "costed_share": sum(n["median_ms"] for n in costed) / node_ms if node_ms else 0.0,
        "note": note,
    }


def _original_source(source: str, manifest: Manifest | None) -> str:
    """What to hand `kiln optimize` again: the model an artifact was built from."""
    if not manifest:
        return source
    return manifest.source.path or "<the original model>"


def _provenance_view(nodes: list[dict]) -> list[dict]:
    """Kernel → compiled node → original nodes (and passes), slowest kernels first."""
    return [
        {
            "kernel": n["node"],
            "op_type": n["op_type"],
            "median_ms": n["median_ms"],
            "compiled_nodes": n["graph_nodes"],
            "original": n["original"],
            "passes": n["passes"],
            "module": n["module"],
            "source": n["source"],
        }
        for n in nodes
    ]


def _manifest_summary(manifest: Manifest | None) -> dict | None:
    if not manifest:
        return None
    data = manifest.to_json()
    return {
        "source": data["source"],
        "precision": manifest.precision.get("default"),
        "passes": [p.name for p in manifest.passes if p.rewrites],
        "nodes": manifest.nodes,
        "config": data["config"],
    }


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None
