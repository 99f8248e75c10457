"""Reports of a profile: one self-contained HTML file, a Chrome trace, a terminal table."""

from kiln.report.html import render_html, write_html
from kiln.report.terminal import print_profile
from kiln.report.trace import trace_events, write_trace

__all__ = ["print_profile", "render_html", "trace_events", "write_html", "write_trace"]
