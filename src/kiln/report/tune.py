"""`kiln tune`'s report: the final table (defaults vs tuned, each changed knob, the measured
gain with its interval) and a self-contained HTML page (trials over time, the Pareto front,
parameter importances). Takes `TuneResult.to_json()`: plain data, no tuner import."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import plotly.graph_objects as go
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kiln.report.charts import LAYOUT
from kiln.report.html import div, render, write_page


def _interval(value: dict[str, float], unit: str = "", digits: int = 3) -> str:
    return (
        f"{value['value']:.{digits}g}{unit} ({value['low']:.{digits}g}–{value['high']:.{digits}g})"
    )


def print_tune(result: dict[str, Any], console: Console) -> None:
    gains = result["gains"]
    measured = gains.get("measured") or {}
    title = f"kiln tune → {escape(result.get('artifact') or '(no artifact written)')}"
    table = Table(title=title, show_header=True)
    tuned_head = f"tuned (trial {measured['trial']})" if "trial" in measured else "tuned"
    for column in ("", "defaults", tuned_head):
        table.add_column(column, overflow="fold")
    table.add_row("configuration", escape(_configuration(result["defaults"]["params"])),
                  escape(_measured(measured)))  # fmt: skip
    tuned, defaults = gains["tuned"], gains["defaults"]
    for key, label, unit in (("p50_ms", "P50 (median of rounds)", " ms"),
                             ("p99_ms", "P99 (windows)", " ms"),
                             ("jitter", "jitter (P99−P50)/P50", "")):  # fmt: skip
        table.add_row(label, _interval(defaults[key], unit), _interval(tuned[key], unit))
    table.add_row("memory (session peak)", _mib(defaults.get("memory_mib")),
                  _mib(tuned.get("memory_mib")))  # fmt: skip
    speed = gains["speedup"]
    table.add_row(
        "speedup (P50 ratio)", "1×",
        f"{speed['value']:.2f}× (95 % interval {speed['low']:.2f}–{speed['high']:.2f}, "
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
    for knob, (before, after) in sorted(_changed(result).items()):
        table.add_row(f"  {escape(knob)}", escape(str(before)), escape(str(after)))
    console.print(table)
    console.print(
        f"study {escape(result['study'])} on {escape(result['storage'])}: "
        + escape(trial_states(result["trials"]))
        + (
            f"; warm start from {escape(', '.join(result['warm_start']))}"
            if result["warm_start"]
            else ""
        )  # fmt: skip
    )


# What each Optuna state means to someone reading a study's counts.
_STATES = {
    "COMPLETE": "measured",
    "PRUNED": "refused, outside the budget, or a duplicate of another trial",
    "FAIL": "their worker died; retried by the others",
    "RUNNING": "still measured by another worker",
    "WAITING": "queued seed or warm-start configurations not run yet; more --trials runs them",
}


def trial_states(counts: dict[str, int]) -> str:
    """`{"COMPLETE": 1, "WAITING": 3}` → "1 complete (measured), 3 waiting (queued ...)"."""
    return ", ".join(f"{n} {s.lower()}" + (f" ({_STATES[s]})" if s in _STATES else "")
                     for s, n in sorted(counts.items()))  # fmt: skip


def _changed(result: dict[str, Any]) -> dict[str, list[Any]]:
    """Knob → [default, tuned] of the configuration measured against the defaults."""
    measured = result["gains"].get("measured") or {}
    return measured.get("changed") or {k: list(v) for k, v in result["changed"].items()}


def _configuration(params: dict[str, Any]) -> str:
    engine = params.get("engine", "?")
    return f"{engine} {params.get(f'{engine}.precision', 'fp32')}, the engine's defaults"


def _measured(measured: dict[str, Any]) -> str:
    if not measured:
        return ""
    knobs = len(measured.get("changed") or {})
    return (f"{measured['engine']} {measured['precision']}, "
            + (f"{knobs} knob{'s' * (knobs != 1)} changed (below)" if knobs
               else "the defaults"))  # fmt: skip


def _mib(value: float | None) -> str:
    return "not measured (see --max-memory)" if value is None else f"{value:.1f} MiB"


def _serving(serving: dict[str, Any]) -> str:
    text = f"batches of up to {serving['max_batch']} within {serving['max_delay_ms']:g} ms"
    if "buckets" in serving:
        sizes = " ".join(f"{d}={','.join(map(str, v))}" for d, v in serving["buckets"].items())
        text += f"; buckets {sizes or 'none (the dynamic executable)'}"
    return text


def _axis(result: dict[str, Any], index: int, fallback: str) -> str:
    """An objective's name with its unit, e.g. "latency (ms)"."""
    described = result.get("objectives") or []
    if index >= len(described):
        return fallback
    unit = described[index]["unit"]
    return f"{described[index]['name']} ({unit})" if unit else described[index]["name"]


def _minimize(result: dict[str, Any]) -> bool:
    described = result.get("objectives") or [{"direction": "minimize"}]
    return described[0]["direction"] == "minimize"


def _best_so_far(result: dict[str, Any]) -> dict[int, float]:
    """Trial number → the best first objective among the feasible measured trials so far."""
    best: float | None = None
    out = {}
    better = min if _minimize(result) else max
    for h in sorted(result["history"], key=lambda h: h["trial"]):
        if h["state"] == "COMPLETE" and h["values"] and not h.get("outside"):
            best = h["values"][0] if best is None else better(best, h["values"][0])
        if best is not None:
            out[h["trial"]] = best
    return out


def _trials_figure(result: dict[str, Any], objectives: list[str]) -> go.Figure:
    figure = go.Figure()
    done = [h for h in result["history"] if h["values"]]
    for index, name in enumerate(objectives):
        figure.add_trace(go.Scatter(
            x=[h["trial"] for h in done], y=[h["values"][index] for h in done],
            mode="markers", name=_axis(result, index, name),
        ))  # fmt: skip
    best = _best_so_far(result)
    figure.add_trace(go.Scatter(x=list(best), y=list(best.values()), mode="lines",
                                line={"shape": "hv"}, name="best so far"))  # fmt: skip
    figure.update_layout(title="trials", xaxis_title="trial number",
                         yaxis_title=_axis(result, 0, objectives[0]), **LAYOUT)  # fmt: skip
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
    figure.update_layout(title="Pareto front", xaxis_title=_axis(result, 0, objectives[0]),
                         yaxis_title=_axis(result, 1, objectives[1]), **LAYOUT)  # fmt: skip
    return figure


def _importance_figure(importances: dict[str, float]) -> go.Figure:
    names = sorted(importances, key=importances.get)
    figure = go.Figure(go.Bar(x=[importances[n] for n in names], y=names, orientation="h"))
    figure.update_layout(
        title="parameter importance (fANOVA)",
        xaxis_title="share of the first objective's variance",
        **LAYOUT,
    )
    return figure


def _outcome(h: dict[str, Any], front: set[int], pick: int | None) -> str:
    """Why a trial stands where it does, in words."""
    if h.get("refused"):
        return f"refused: {h['refused']}"
    if h.get("duplicate_of") is not None:
        return f"duplicate of trial {h['duplicate_of']}"
    if h.get("outside"):
        return f"outside {', '.join(h['outside'])}"
    if h["state"] != "COMPLETE":
        return _STATES.get(h["state"], h["state"].lower())
    tags = ["picked"] * (h["trial"] == pick) + ["Pareto front"] * (h["trial"] in front)
    return ", ".join(tags) or "measured"


def _trial_rows(result: dict[str, Any], objectives: list[str]) -> tuple[list, list]:
    """The every-trial table: its heads, and one row of cells per trial."""
    front = {f["trial"] for f in result["pareto"]}
    pick = result["pick"].get("trial")
    best = _best_so_far(result)
    heads = [
        "trial",
        "state",
        *(_axis(result, i, n) for i, n in enumerate(objectives)),
        f"best so far ({_axis(result, 0, objectives[0])})",
        "outcome",
        "configuration",
    ]
    rows = []
    for h in sorted(result["history"], key=lambda h: h["trial"]):
        values = h["values"] or [None] * len(objectives)
        rows.append([str(h["trial"]), h["state"].lower(),
                     *("" if v is None else f"{v:.4g}" for v in values[: len(objectives)]),
                     f"{best[h['trial']]:.4g}" if h["trial"] in best else "",
                     _outcome(h, front, pick),
                     ", ".join(f"{k}={v}" for k, v in sorted(h["params"].items()))])  # fmt: skip
    return heads, rows


def tune_html(result: dict[str, Any], objectives: list[str]) -> str:
    figures = [_trials_figure(result, objectives)]
    if len(objectives) >= 2:
        figures.append(_pareto_figure(result, objectives))
    if result.get("importances"):
        figures.append(_importance_figure(result["importances"]))
    gains = result["gains"]
    heads, rows = _trial_rows(result, objectives)
    return render(
        "tune.html.j2", r=result, gains=gains, speed=gains["speedup"],
        trial=(gains.get("measured") or {}).get("trial"), changed=sorted(_changed(result).items()),
        states=trial_states(result["trials"]), figures=[div(f) for f in figures], heads=heads,
        rows=rows,
    )  # fmt: skip


def write_tune_html(result: dict[str, Any], objectives: list[str], path: str | Path) -> Path:
    return write_page(tune_html(result, objectives), path)
