"""Kiln's self-contained HTML reports — `kiln profile`, `kiln train --profile`, `kiln tune`,
`kiln compare` — all rendered on one Jinja environment over this package's templates (each
extends base.html.j2): plotly's JavaScript is embedded, nothing is fetched."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jinja2
import plotly.offline

from kiln.home import atomic_write_text
from kiln.report.charts import (
    memory_figure,
    memory_plan_figure,
    roofline_figure,
    timeline_figure,
)
from kiln.report.terminal import mib, module_and_source

# No links to plotly's site and no mode bar buttons that would reach the network.
_CONFIG = {"displaylogo": False, "responsive": True}


@functools.cache
def environment() -> jinja2.Environment:
    """The one environment every report renders on: autoescaped, strict about names."""
    made = jinja2.Environment(
        loader=jinja2.FileSystemLoader(Path(__file__).parent),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    made.filters["module_and_source"] = module_and_source
    made.filters["mib"] = mib
    return made


def render(template: str, **values: Any) -> str:
    """The page `template` makes of `values`, plotly's JavaScript inlined."""
    page = environment().get_template(template)
    return page.render(plotly_js=plotly.offline.get_plotlyjs(), **values)


def write_page(text: str, path: str | Path) -> Path:
    """A rendered page written atomically: a reader never sees half a report."""
    path = Path(path)
    atomic_write_text(path, text)
    return path


def div(figure: Any, div_id: str | None = None) -> str:
    """A plotly figure as a <div> for a page that inlines plotly's JavaScript once."""
    return figure.to_html(full_html=False, include_plotlyjs=False, div_id=div_id, config=_CONFIG)


def render_html(result: dict[str, Any]) -> str:
    """`kiln profile`'s page of a `profile_model` result."""
    planned = _planned(result)
    return render(
        "profile.html.j2",
        r=result,
        roofline=div(roofline_figure(result), "roofline"),
        timeline=div(timeline_figure(result), "timeline"),
        memory=div(memory_figure(result), "memory"),
        planned=planned,
        memory_plan=div(memory_plan_figure(result), "memory-plan") if planned else "",
    )


def write_html(result: dict[str, Any], path: str | Path) -> Path:
    return write_page(render_html(result), path)


def _planned(result: dict[str, Any]) -> bool:
    """Whether the profile carries a memory plan (shape inference may have failed)."""
    return "live_peak_mib" in (result.get("memory_plan") or {})
