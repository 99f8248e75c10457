"""`kiln compare`'s report: a terminal table of the layers and the first divergence, and a
self-contained HTML page (the error per layer along the graph, every row in a table). Takes
`Comparison.to_json()`: plain data, no import of kiln.debug."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from kiln.report.charts import LAYOUT
from kiln.report.html import div, render, write_page
from kiln.report.terminal import module_and_source

MAX_TABLE_ROWS = 40  # a bigger model shows the rows around the first divergence and the worst
CONTEXT = 5


def _number(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "-"
    if math.isnan(value):
        return "NaN"
    return f"{value:.{digits}g}"


def _cosine(value: float | None) -> str:
    if value is None:
        return "-"
    return "NaN" if math.isnan(value) else f"{min(value, 1.0):.6f}"


def _side(made: dict[str, Any]) -> str:
    passes = ",".join(made.get("passes") or []) or "-"
    return f"{made.get('precision')} {passes}"


def headline(result: dict[str, Any]) -> str:
    """One sentence: where the two sides part, or that they do not."""
    first = result["first_divergence_row"]
    if not result.get("related", True):
        kept = sum(row["ok"] for row in result["layers"])
        return (
            f"not two versions of one model: only the outputs are compared, {kept} of "
            f"{len(result['layers'])} within {result['budget']['text']}; no layer to blame."
        )
    if first is None:
        if result["exact"] == len(result["layers"]):
            return f"no divergence: all {len(result['layers'])} compared tensors are identical."
        return f"no divergence: every compared tensor is within {result['budget']['text']}."
    budget = result["budget"]
    shows_at = first.get("shows_at")
    if shows_at:  # the lossy layer upstream whose error an fp32 layer carries past the budget
        return (
            f"first divergence: {first['node']} ({first['op_type']}, layer {first['index']}, "
            f"{first['b']['precision']}): {_measure(first, budget)}, within {budget['text']} "
            f"itself, adds the error that {shows_at['node']} ({shows_at['op_type']}, layer "
            f"{shows_at['index']}) carries to {_measure(shows_at, budget)}, beyond it."
        )
    measure = _measure(first, budget)
    problem = f" ({first['problem']})" if first.get("problem") else ""
    return (
        f"first divergence: {first['node']} ({first['op_type']}, layer {first['index']}): "
        f"{measure}, beyond {result['budget']['text']}, while its inputs agree{problem}."
    )


def _measure(row: dict[str, Any], budget: dict[str, Any]) -> str:
    if budget["metric"] == "cosine":
        return f"cosine {_cosine(row['cosine'])}"
    return f"max abs {_number(row['max_abs'])}"


def shown_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Every row of a small model; else the rows around the first divergence and the worst."""
    rows = result["layers"]
    if len(rows) <= MAX_TABLE_ROWS:
        return rows
    picked: set[int] = set()
    first = result["first_divergence_row"]
    if first is not None:
        picked |= set(range(max(0, first["index"] - CONTEXT), first["index"] + CONTEXT + 1))
    worst = sorted(rows, key=_badness, reverse=True)[: MAX_TABLE_ROWS - len(picked)]
    picked |= {r["index"] for r in worst}
    return [r for r in rows if r["index"] in picked]


def _badness(row: dict[str, Any]) -> float:
    cosine = row["cosine"]
    if cosine is None or math.isnan(cosine):
        return math.inf if row["problem"] else row["max_abs"]
    return 1.0 - cosine


def print_compare(result: dict[str, Any], console: Console) -> None:
    a, b = result["a"], result["b"]
    with_a = a["kind"] != "model"  # an original as-is: nothing to say about its nodes
    table = Table(title=f"kiln compare: {escape(a['spec'])} → {escape(b['spec'])}")
    rows = shown_rows(result)
    traced = any(row.get("module") or row.get("source") for row in rows)  # a PyTorch source
    columns = ["#", "node (original)", "op"] + ["module · source"] * traced + ["max abs", "cosine"]
    columns += ["A: precision passes"] * with_a + ["B: precision passes", ""]
    for column in columns:
        table.add_column(column, overflow="fold")
    first = _first_index(result)
    for row in rows:
        mark = "FIRST" if row["index"] == first else "" if row["ok"] else "over"
        style = "bold red" if mark == "FIRST" else "red" if mark else None
        cells = [str(row["index"]), escape(row["node"]), escape(row["op_type"])]
        cells += [escape(module_and_source(row))] * traced
        cells += [_number(row["max_abs"]), _cosine(row["cosine"])]
        cells += [escape(_side(row["a"]))] * with_a + [escape(_side(row["b"])), mark]
        table.add_row(*cells, style=style)
    console.print(table)
    if len(rows) < len(result["layers"]):
        console.print(
            f"{len(rows)} of {len(result['layers'])} layers shown (around the first divergence "
            "and the worst); --json or -o report.html has them all.",
            highlight=False,
        )
    console.print(
        f"A: {escape(a['spec'])} on {a['engine']} {a['precision']}; B: {escape(b['spec'])} on "
        f"{b['engine']} {b['precision']}; inputs {escape(result['inputs'])}; "
        f"{compared(result)}; "
        f"budget {result['budget']['text']}",
        highlight=False,
    )
    for note in result["notes"]:
        console.print(f"note: {escape(note)}", highlight=False)
    console.print(escape(headline(result)), highlight=False)


def compared(result: dict[str, Any]) -> str:
    """How many tensors the rows compare, the model's outputs told apart from the rest."""
    total, shared = len(result["layers"]), result["shared_tensors"]
    outputs = total - shared
    return (
        f"{total} tensor{'s' if total != 1 else ''} compared ({shared} intermediate, "
        f"{outputs} output{'s' if outputs != 1 else ''})"
    )


def _error_figure(result: dict[str, Any]) -> go.Figure:
    rows = result["layers"]
    figure = go.Figure()
    names = [r["node"] for r in rows]
    figure.add_trace(go.Scatter(
        x=[r["index"] for r in rows], y=[r["max_abs"] for r in rows], mode="lines+markers",
        name="max abs", text=names, yaxis="y",
    ))  # fmt: skip
    figure.add_trace(go.Scatter(
        x=[r["index"] for r in rows], y=[r["cosine"] for r in rows], mode="lines+markers",
        name="cosine", text=names, yaxis="y2",
    ))  # fmt: skip
    first = result["first_divergence_row"]
    if first is not None:
        figure.add_vline(x=first["index"], line_color="#b71c1c", annotation_text=first["node"])
    figure.update_layout(
        title="error per layer (original topological order)",
        xaxis_title="layer",
        yaxis={"title": "max abs", "type": "log"},
        yaxis2={"title": "cosine", "overlaying": "y", "side": "right"},
        **LAYOUT,
    )
    return figure


def _first_index(result: dict[str, Any]) -> int | None:
    first = result["first_divergence_row"]
    return None if first is None else first["index"]


def compare_html(result: dict[str, Any]) -> str:
    first = _first_index(result)
    rows = [
        {"mark": "first" if r["index"] == first else "" if r["ok"] else "over",
         "cells": [r["index"], r["node"], r["op_type"], module_and_source(r),
                   _number(r["max_abs"]), _number(r["max_rel"]), _cosine(r["cosine"]),
                   _side(r["a"]), _side(r["b"])]}
        for r in result["layers"]
    ]  # fmt: skip
    return render("compare.html.j2", r=result, a=result["a"], b=result["b"],
                  headline=headline(result), compared=compared(result),
                  figure=div(_error_figure(result)),
                  rows=rows)  # fmt: skip


def write_compare_html(result: dict[str, Any], path: str | Path) -> Path:
    return write_page(compare_html(result), path)
