"""Kiln's reports. Exported here, `kiln profile`'s: one self-contained HTML page, a Chrome
trace, a terminal table; beside them `kiln tune`'s (report.tune), `kiln compare`'s
(report.compare) and `kiln train --profile`'s (report.train). Every HTML page renders on one
Jinja environment (report.html)."""

from kiln.report.html import render_html, write_html
from kiln.report.terminal import print_profile
from kiln.report.trace import trace_events, write_trace

__all__ = ["print_profile", "render_html", "trace_events", "write_html", "write_trace"]
