"""One self-contained HTML report: plotly's JavaScript is embedded, nothing is fetched."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2
import plotly.offline

from kiln.report.charts import (
    memory_figure,
    memory_plan_figure,
    roofline_figure,
    timeline_figure,
)
from kiln.report.terminal import mib, module_and_source

# No links to plotly's site and no mode bar buttons that would reach the network.
_CONFIG = {"displaylogo": False, "responsive": True}


def render_html(result: dict[str, Any]) -> str:
    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(Path(__file__).parent),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    environment.filters["module_and_source"] = module_and_source
    environment.filters["mib"] = mib
    template = environment.get_template("template.html.j2")
    return template.render(
        r=result,
        plotly_js=plotly.offline.get_plotlyjs(),
        roofline=_div(roofline_figure(result), "roofline"),
        timeline=_div(timeline_figure(result), "timeline"),
        memory=_div(memory_figure(result), "memory"),
        planned=_planned(result),
        memory_plan=(_div(memory_plan_figure(result), "memory-plan") if _planned(result) else ""),
    )


def write_html(result: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.write_text(render_html(result), encoding="utf-8")
    return path


def _planned(result: dict[str, Any]) -> bool:
    """Whether the profile carries a memory plan (shape inference may have failed)."""
    return "live_peak_mib" in (result.get("memory_plan") or {})


def _div(figure: Any, div_id: str) -> str:
    return figure.to_html(full_html=False, include_plotlyjs=False, div_id=div_id, config=_CONFIG)
