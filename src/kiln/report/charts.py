"""The report's plotly figures: roofline, timeline, memory over time."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

# One look for every report's figures.
LAYOUT = {"margin": {"l": 60, "r": 20, "t": 40, "b": 50}, "template": "plotly_white"}


def roofline_figure(result: dict[str, Any]) -> go.Figure:
    """Log-log: one memory slope per level of the memory hierarchy measured (DRAM, and the
    L2/L3 ceilings a small working set meets), one compute roof per measured precision, and
    every costed kernel at (arithmetic intensity, achieved GFLOP/s), sized by its time."""
    roofs = result["roofline"]["roofs"]
    nodes = [n for n in result["nodes"] if n.get("intensity") and n.get("achieved_gflops")]
    memory = roofs.get("memory") or {"DRAM": roofs["bandwidth_gbs"]}
    bandwidth = roofs["bandwidth_gbs"]
    xs = [n["intensity"] for n in nodes] or [1.0]
    low = min(min(xs), 0.01) / 2
    high = max(max(xs), 2 * max(roofs["compute"].values()) / bandwidth) * 2
    top = max(roofs["compute"].values())
    figure = go.Figure()
    for level, speed in memory.items():
        figure.add_trace(
            go.Scatter(
                x=[low, top / speed],
                y=[low * speed, top],
                mode="lines",
                name=f"{level} bandwidth ({speed:.0f} GB/s)",
                line={"dash": "solid" if level == "DRAM" else "dash", "width": 1},
            )
        )
    for precision, peak in roofs["compute"].items():
        figure.add_trace(
            go.Scatter(
                x=[peak / max(memory.values()), high],
                y=[peak, peak],
                mode="lines",
                name=f"{precision} roof ({peak:.0f} GFLOP/s)",
                line={"dash": "solid" if precision == "fp32" else "dot"},
            )
        )
    by_op: dict[str, list[dict[str, Any]]] = {}
    for node in nodes:
        by_op.setdefault(node["op_type"], []).append(node)
    longest = max((n["median_ms"] for n in nodes), default=1.0) or 1.0
    for op_type, members in sorted(by_op.items()):
        figure.add_trace(
            go.Scatter(
                x=[n["intensity"] for n in members],
                y=[n["achieved_gflops"] for n in members],
                mode="markers",
                name=op_type,
                marker={"size": [6 + 24 * (n["median_ms"] / longest) ** 0.5 for n in members]},
                text=[_hover(n) for n in members],
                hoverinfo="text",
            )
        )
    figure.update_layout(
        title="roofline",
        xaxis={"type": "log", "title": "arithmetic intensity (FLOP/byte)"},
        yaxis={"type": "log", "title": "achieved GFLOP/s"},
        height=520,
        **LAYOUT,
    )
    return figure


def _hover(node: dict[str, Any]) -> str:
    """One kernel: its time, and the roof it is held to (precision, memory level)."""
    return (
        f"{node['node']}<br>{node['median_ms']:.3f} ms/run, {node['precision']}, working set "
        f"in {node.get('memory_level', 'DRAM')}<br>{node.get('efficiency', 0):.0%} of its roof "
        f"({node.get('bound', '?')}-bound)"
    )


def timeline_figure(result: dict[str, Any]) -> go.Figure:
    """One run (the median one): a bar per kernel, one row per operator type."""
    spans = result["timeline"]
    figure = go.Figure(
        go.Bar(
            base=[s["start_us"] / 1e3 for s in spans],
            x=[s["dur_us"] / 1e3 for s in spans],
            y=[s["op_type"] for s in spans],
            orientation="h",
            text=[s["node"] for s in spans],
            hovertemplate="%{text}<br>start %{base:.3f} ms, %{x:.3f} ms<extra></extra>",
            textposition="none",
        )
    )
    rows = len({s["op_type"] for s in spans})
    figure.update_layout(
        title="timeline of one run (ms)",
        xaxis={"title": "ms from the start of the run"},
        height=max(240, 60 + 22 * rows),
        **LAYOUT,
    )
    return figure


def memory_figure(result: dict[str, Any]) -> go.Figure:
    """RSS over the whole measurement, with the phase boundaries marked."""
    memory = result["memory"]
    figure = go.Figure(
        go.Scatter(x=memory["t_s"], y=memory["rss_mib"], mode="lines", name="RSS (MiB)")
    )
    for mark in memory["marks"]:
        figure.add_vline(x=mark["t_s"], line={"width": 1, "dash": "dot", "color": "#999"})
        figure.add_annotation(
            x=mark["t_s"], y=1, yref="paper", text=mark["label"], showarrow=False,
            textangle=-90, xanchor="left", yanchor="top", font={"size": 9},
        )  # fmt: skip
    figure.update_layout(
        title="process memory (RSS) over time",
        xaxis={"title": "seconds"},
        yaxis={"title": "MiB"},
        height=340,
        showlegend=False,
        **LAYOUT,
    )
    return figure


def memory_plan_figure(result: dict[str, Any]) -> go.Figure:
    """Bytes alive while each node runs, in the graph's execution order (the memory plan), with
    the planner's arena and the engine's measured growth drawn across for comparison."""
    plan = result["memory_plan"]
    series = plan["series"]
    steps = list(range(len(series["live_mib"])))
    figure = go.Figure(
        go.Scatter(
            x=steps,
            y=series["live_mib"],
            mode="lines",
            line={"shape": "hv"},
            fill="tozeroy",
            name="alive (MiB)",
            text=[f"{n} ({o})" for n, o in zip(series["node"], series["op_type"], strict=True)],
            hovertemplate="step %{x}: %{text}<br>%{y:.3f} MiB alive<extra></extra>",
        )
    )
    levels = (
        ("greedy-by-size arena", plan["greedy_arena_mib"], "dash"),
        ("measured first-run growth", plan["measured_peak_mib"], "dot"),
    )
    for label, mib, dash in levels:
        if mib > 0:  # RSS can shrink over a run: nothing to draw then
            figure.add_hline(
                y=mib, line={"dash": dash, "width": 1, "color": "#555"},
                annotation_text=f"{label} {mib:.3g} MiB", annotation_position="top left",
                annotation_font_size=10,
            )  # fmt: skip
    peak = plan["peak"]
    if peak["step"] >= 0:
        figure.add_trace(
            go.Scatter(
                x=[peak["step"]],
                y=[plan["live_peak_mib"]],
                mode="markers",
                marker={"size": 9, "color": "#d62728"},
                name="live peak",
                text=[peak["node"]],  # as data, not in the template: names may hold "%{"
                hovertemplate="live peak at %{text}<br>%{y:.3f} MiB<extra></extra>",
            )
        )
    figure.update_layout(
        title="activation memory over the execution order (plan)",
        xaxis={"title": "node (execution order)"},
        yaxis={"title": "MiB alive", "rangemode": "tozero"},
        height=340,
        showlegend=False,
        **LAYOUT,
    )
    return figure
