"""`kiln tune`'s report: the final table (defaults vs tuned, each changed knob, the measured
gain with its interval) and a self-contained HTML page (trials over time, the Pareto front,
parameter importances). Takes `TuneResult.to_json()`: plain data, no tuner import."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
import plotly.offline
from rich.console import Console
from rich.markup import escape
from rich.table import Table

_CONFIG = {"displaylogo": False, "responsive": True}
_LAYOUT = {"margin": {"l": 60, "r": 20, "t": 40, "b": 50}, "template": "plotly_white"}


def _interval(value: dict[str, float], unit: str = "", digits: int = 3) -> str:
    return (
        f"{value['value']:.{digits}g}{unit} ({value['low']:.{digits}g}–{value['high']:.{digits}g})"
    )


def print_tune(result: dict[str, Any], console: Console) -> None:
    gains = result["gains"]
    title = f"kiln tune → {escape(result.get('artifact') or '(no artifact written)')}"
    table = Table(title=title, show_header=True)
    for column in ("", "defaults", "tuned"):
        table.add_column(column, overflow="fold")
    tuned, defaults = gains["tuned"], gains["defaults"]
    for key, label, unit in (("p50_ms", "P50", " ms"), ("p99_ms", "P99 (windows)", " ms"),
                             ("jitter", "jitter (P99−P50)/P50", "")):  # fmt: skip
        table.add_row(label, _interval(defaults[key], unit), _interval(tuned[key], unit))
    table.add_row("memory", f"{defaults['memory_mib']:.0f} MiB", f"{tuned['memory_mib']:.0f} MiB")
    speed = gains["speedup"]
    table.add_row(
        "speedup (P50)", "1×",
        f"{speed['value']:.2f}× ({speed['low']:.2f}–{speed['high']:.2f}, "
        f"{speed['runs']} runs each, interleaved)",
    )  # fmt: skip
    if "throughput_ratio" in gains:
        table.add_row("throughput", "1×", _interval(gains["throughput_ratio"], "×"))
    if "serving" in gains:  # what kiln serve takes from the artifact
        table.add_row("kiln serve", "", escape(_serving(gains["serving"])))
    kept = (
        f"tuned (trial {result['pick']['trial']})" if gains["verdict"] == "better"
        else "the defaults" if gains["verdict"].startswith("the defaults")
        else f"the defaults: the best trial was {gains['verdict']} beyond noise"
    )  # fmt: skip
    table.add_row("verdict", "", f"{gains['verdict']}; written: {kept}")
    for knob, (before, after) in sorted(result["changed"].items()):
        table.add_row(f"  {escape(knob)}", escape(str(before)), escape(str(after)))
    console.print(table)
    states = ", ".join(f"{n} {s.lower()}" for s, n in sorted(result["trials"].items()))
    console.print(
        f"study {escape(result['study'])} on {escape(result['storage'])}: {states}"
        + (
            f"; warm start from {escape(', '.join(result['warm_start']))}"
            if result["warm_start"]
            else ""
        )  # fmt: skip
    )


def _serving(serving: dict[str, Any]) -> str:
    text = f"batches of up to {serving['max_batch']} within {serving['max_delay_ms']:g} ms"
    if "buckets" in serving:
        sizes = " ".join(f"{d}={','.join(map(str, v))}" for d, v in serving["buckets"].items())
        text += f"; buckets {sizes or 'none (the dynamic executable)'}"
    return text


def _trials_figure(result: dict[str, Any], objectives: list[str]) -> go.Figure:
    figure = go.Figure()
    done = [h for h in result["history"] if h["values"]]
    for index, name in enumerate(objectives):
        figure.add_trace(go.Scatter(
            x=[h["trial"] for h in done], y=[h["values"][index] for h in done],
            mode="markers", name=name,
        ))  # fmt: skip
    figure.update_layout(title="trials", xaxis_title="trial", **_LAYOUT)
    return figure


def _pareto_figure(result: dict[str, Any], objectives: list[str]) -> go.Figure:
    figure = go.Figure()
    done = [h for h in result["history"] if h["values"] and len(h["values"]) >= 2]
    front = result["pareto"]
    figure.add_trace(go.Scatter(x=[h["values"][0] for h in done],
                                y=[h["values"][1] for h in done], mode="markers",
                                name="trials"))  # fmt: skip
    figure.add_trace(go.Scatter(x=[f["values"][0] for f in front],
                                y=[f["values"][1] for f in front], mode="markers",
                                name="Pareto front", marker={"size": 12}))  # fmt: skip
    figure.update_layout(title="Pareto front", xaxis_title=objectives[0],
                         yaxis_title=objectives[1], **_LAYOUT)  # fmt: skip
    return figure


def _importance_figure(importances: dict[str, float]) -> go.Figure:
    names = sorted(importances, key=importances.get)
    figure = go.Figure(go.Bar(x=[importances[n] for n in names], y=names, orientation="h"))
    figure.update_layout(title="parameter importance (fANOVA)", **_LAYOUT)
    return figure


def tune_html(result: dict[str, Any], objectives: list[str]) -> str:
    figures = [_trials_figure(result, objectives)]
    if len(objectives) >= 2:
        figures.append(_pareto_figure(result, objectives))
    if result.get("importances"):
        figures.append(_importance_figure(result["importances"]))
    divs = "\n".join(
        f.to_html(full_html=False, include_plotlyjs=False, config=_CONFIG) for f in figures
    )
    rows = "".join(
        f"<tr><td>{html.escape(k)}</td><td>{html.escape(str(a))}</td>"
        f"<td>{html.escape(str(b))}</td></tr>"
        for k, (a, b) in sorted(result["changed"].items())
    )
    speed = result["gains"]["speedup"]
    return f"""<!doctype html><html><head><meta charset="utf-8">
<title>kiln tune {html.escape(result["study"])}</title>
<script>{plotly.offline.get_plotlyjs()}</script>
<style>body{{font-family:sans-serif;margin:2em}}td,th{{padding:2px 10px}}</style></head><body>
<h1>kiln tune — {html.escape(result["study"])}</h1>
<p>verdict: <b>{html.escape(result["gains"]["verdict"])}</b>; speedup {speed["value"]:.2f}×
({speed["low"]:.2f}–{speed["high"]:.2f}) over {speed["runs"]} interleaved runs each.</p>
<table><tr><th>knob</th><th>default</th><th>tuned</th></tr>{rows}</table>
{divs}
</body></html>"""


def write_tune_html(result: dict[str, Any], objectives: list[str], path: str | Path) -> Path:
    path = Path(path)
    path.write_text(tune_html(result, objectives), encoding="utf-8")
    return path
