"""`kiln train --profile`'s report: a self-contained HTML page (each step's split, the
achieved GFLOP/s against the measured peak, memory over time by category, the bottlenecks
with their fixes) and the terminal view. Takes `StepProfile.to_json()` and the findings'
`to_json()`: plain data, no import of kiln.train (nor of PyTorch)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
from rich.markup import escape
from rich.table import Table

from kiln.report.charts import LAYOUT
from kiln.report.html import div, render, write_page

PART_LABELS = {"communication": "communication (exposed)"}
COLORS = {
    "data": "#e4a11b", "forward": "#4c78a8", "backward": "#72b7b2", "optimizer": "#54a24b",
    "communication": "#e45756", "other": "#bab0ac",
    "parameters": "#2f6b2f", "gradients": "#3b5bdb", "optimizer state": "#c9a227",
    "activations": "#d9480f",
}  # fmt: skip


def _parts(profile: dict[str, Any]) -> list[str]:
    """The parts a step is split into, in the profiler's order."""
    return list(profile["split_ms"])


def _label(part: str) -> str:
    return PART_LABELS.get(part, part)


def _share(profile: dict[str, Any], part: str) -> float:
    step = profile["step_ms"]
    return profile["split_ms"][part] / step if step > 0 else 0.0


def render_train_html(profile: dict[str, Any], findings: list[dict[str, Any]]) -> str:
    parts = _parts(profile)
    return render(
        "train.html.j2", p=profile, findings=findings, parts=parts,
        labels={part: _label(part) for part in parts},
        split=div(_split_figure(profile), "split"),
        compute=div(_compute_figure(profile), "compute") if profile["achieved_gflops"] else "",
        memory=div(_memory_figure(profile["memory"]), "memory") if profile["memory"]["t_ms"]
        else "",
    )  # fmt: skip


def write_train_html(
    profile: dict[str, Any], findings: list[dict[str, Any]], path: str | os.PathLike
) -> Path:
    return write_page(render_train_html(profile, findings), path)


def _split_figure(profile: dict[str, Any]) -> go.Figure:
    """One stacked bar per timed step: its parts, adding up to its wall time."""
    steps = profile["steps"]
    numbers = list(range(1, len(steps) + 1))
    figure = go.Figure()
    for part in _parts(profile):
        figure.add_trace(go.Bar(
            x=numbers, y=[s[part] for s in steps], name=_label(part),
            marker_color=COLORS[part], hovertemplate="%{y:.2f} ms<extra>" + part + "</extra>",
        ))  # fmt: skip
    figure.update_layout(title="each step's wall time, by part (ms)", barmode="stack",
                         xaxis={"title": "timed step", "dtick": 1}, yaxis={"title": "ms"},
                         height=380, **LAYOUT)  # fmt: skip
    return figure


def _compute_figure(profile: dict[str, Any]) -> go.Figure:
    """Achieved GFLOP/s beside the measured peak it is a fraction of."""
    bars = {"achieved": profile["achieved_gflops"]}
    if profile["peak_gflops"]:
        bars[f"{profile['peak_precision']} peak (measured)"] = profile["peak_gflops"]
    figure = go.Figure(go.Bar(
        x=list(bars.values()), y=list(bars), orientation="h",
        marker_color=["#4c78a8", "#bab0ac"][: len(bars)],
        text=[f"{v:.1f} GFLOP/s" for v in bars.values()], textposition="auto",
    ))  # fmt: skip
    mfu = profile["mfu"]
    title = "achieved GFLOP/s" + (f" · MFU {mfu:.1%}" if mfu else "")
    figure.update_layout(title=title, xaxis={"title": "GFLOP/s"}, height=220, **LAYOUT)
    return figure


def _memory_figure(memory: dict[str, Any]) -> go.Figure:
    """Memory over the profiled steps, stacked by category, the steps' starts marked."""
    figure = go.Figure()
    for name, column in memory["mib"].items():
        if any(column):
            figure.add_trace(go.Scatter(
                x=memory["t_ms"], y=column, name=name, stackgroup="memory",
                mode="lines", line={"width": 0.5, "color": COLORS.get(name, "#bab0ac")},
            ))  # fmt: skip
    for index, mark in enumerate(memory["steps_ms"], 1):
        figure.add_vline(x=mark, line={"width": 1, "dash": "dot", "color": "#999"})
        figure.add_annotation(x=mark, y=1, yref="paper", text=f"step {index}",
                              showarrow=False, xanchor="left", font={"size": 9})  # fmt: skip
    figure.update_layout(title=f"memory on {memory['device']} by category (MiB)",
                         xaxis={"title": "ms from the first profiled step"},
                         yaxis={"title": "MiB"}, height=380, **LAYOUT)  # fmt: skip
    return figure


def print_train_profile(
    profile: dict[str, Any], findings: list[dict[str, Any]], console: Any
) -> None:
    """The terminal view (`kiln train --profile`): the split, the FLOP/s and MFU, memory,
    the findings with their fixes."""
    console.print(_headline(profile))
    split = Table(title="one step, by part")
    split.add_column("part")
    split.add_column("ms/step", justify="right")
    split.add_column("share", justify="right")
    for part in _parts(profile):
        split.add_row(_label(part), f"{profile['split_ms'][part]:.2f}",
                      f"{_share(profile, part):.1%}")  # fmt: skip
    split.add_row("[bold]step[/bold]", f"[bold]{profile['step_ms']:.2f}[/bold]", "100%")
    split.add_row("MFU", "", _mfu_text(profile))
    console.print(split)
    table = Table(title="bottlenecks", show_lines=True)
    for column in ("bottleneck", "share", "evidence", "fix"):
        table.add_column(column, overflow="fold")
    for finding in findings:
        table.add_row(escape(finding["title"]), f"{finding['share']:.0%}",
                      escape(finding["evidence"]), escape(finding["action"]))  # fmt: skip
    console.print(table if findings else "no bottleneck found above the thresholds")


def _headline(p: dict[str, Any]) -> str:
    rate = [f"{r:.1f} {u}/s" for r, u in ((p["samples_per_s"], "samples"),
                                           (p["tokens_per_s"], "tokens")) if r]  # fmt: skip
    flops = f" · {p['achieved_gflops']:.1f} GFLOP/s" if p["achieved_gflops"] else ""
    return (
        f"{p['device']}, {p['precision']}, {p['threads']} threads: step {p['step_ms']:.2f} ms "
        f"mean (P50 {p['step_p50_ms']:.2f}; {p['profiled_step_ms']:.2f} under the profiler)"
        + (f" · {', '.join(rate)}" if rate else "")
        + flops
        + f" · peak memory {p['memory'].get('peak_mib', 0):.0f} MiB"
        + (f"\n{p['peak_note']}" if p["peak_note"] else "")
    )


def _mfu_text(p: dict[str, Any]) -> str:
    if p["mfu"] is None:
        return "n/a"
    return f"{p['mfu']:.1%} of the {p['peak_precision']} peak {p['peak_gflops']:.0f} GFLOP/s"
