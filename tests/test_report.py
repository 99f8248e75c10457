"""Reports of a profile: Chrome trace, self-contained HTML (rendered in Chromium), terminal."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser

import pytest
from rich.console import Console

import kiln
from kiln.hardware import Peaks
from kiln.profile import profile_model
from kiln.report import print_profile, trace_events, write_html, write_trace
from kiln.report.terminal import print_bench

PEAKS = Peaks(100.0, 200.0, 400.0, 20.0, 2, "test")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    """A compiled bert-tiny artifact's profile: it has a provenance view as well."""
    where = tmp_path_factory.mktemp("report")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KILN_HOME", str(where / "home"))
        artifact = kiln.compile("zoo:bert-tiny", where / "bert.kiln")
    return profile_model(str(artifact.path), runs=6, rounds=2, peaks=PEAKS)


@pytest.fixture(scope="module")
def html_file(result, tmp_path_factory):
    return write_html(result, tmp_path_factory.mktemp("html") / "report.html")


def test_trace_has_complete_events_with_durations(result, tmp_path):
    path = write_trace(result, tmp_path / "trace.json")
    trace = json.loads(path.read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    kernels = [e for e in events if e["cat"] != "run"]
    assert len([e for e in events if e["cat"] == "run"]) == 6
    assert len(kernels) == len(result["records"])
    for event in kernels:
        assert event["dur"] >= 0 and event["ts"] >= 0
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int)
        assert {"op_type", "kernel", "origin", "original"} <= set(event["args"])
    # runs are laid one after another, never overlapping
    runs = sorted((e for e in events if e["cat"] == "run"), key=lambda e: e["ts"])
    assert all(a["ts"] + a["dur"] <= b["ts"] for a, b in zip(runs, runs[1:], strict=False))
    assert trace_events(result)["displayTimeUnit"] == "ms"


class _Links(HTMLParser):
    """Every URL the page would load: script/img/iframe src, link href."""

    def __init__(self) -> None:
        super().__init__()
        self.loads: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag in {"script", "img", "iframe", "embed", "source"} and attrs.get("src"):
            self.loads.append(attrs["src"])
        if tag == "link" and attrs.get("href"):
            self.loads.append(attrs["href"])


def test_html_is_self_contained(html_file):
    text = html_file.read_text()
    parser = _Links()
    parser.feed(text)
    assert parser.loads == []  # plotly.js is inline; nothing is fetched
    assert "Plotly.newPlot" in text
    for section in ("Top bottlenecks", "Roofline", "Operator types", "Kernels", "Timeline"):
        assert f"<h2>{section}</h2>" in text
    assert "Provenance" in text and "Attention" in text  # a fused kernel and its origins


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def _section(dom: str, div_id: str) -> str:
    """The DOM from the plot's div to the next heading."""
    start = dom.index(f'id="{div_id}"')
    end = dom.find("<h2>", start)
    return dom[start : end if end > 0 else None]


def test_html_renders_in_headless_chromium(html_file, tmp_path):
    if _chromium() is None:
        if os.environ.get("CI") == "true":  # .ci/run installs it: a skip there hides a failure
            pytest.fail("headless Chromium is not installed, and CI must run the browser test")
        pytest.skip("headless Chromium is not installed")
    base = [
        _chromium(),
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        f"--user-data-dir={tmp_path / 'profile'}",
        "--enable-logging=stderr",
        "--v=0",
        "--virtual-time-budget=10000",
    ]
    url = html_file.resolve().as_uri()
    dom = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True, timeout=180)
    assert dom.returncode == 0, dom.stderr[-2000:]
    # Chromium logs every console message (errors and uncaught exceptions included) as
    # "INFO:CONSOLE"; the report logs nothing, so any such line is a problem.
    console = [line for line in dom.stderr.splitlines() if ":CONSOLE" in line]
    assert console == []
    for plot in ("roofline", "timeline", "memory"):
        drawn = _section(dom.stdout, plot)
        assert 'class="main-svg"' in drawn, f"the {plot} plot was not drawn"
    assert re.search(r'class="point"', _section(dom.stdout, "roofline"))  # kernels plotted
    screenshot = tmp_path / "report.png"
    shot = subprocess.run(
        [*base, "--window-size=1280,2400", f"--screenshot={screenshot}", url],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert shot.returncode == 0, shot.stderr[-2000:]
    assert screenshot.stat().st_size > 10_000
    print(f"screenshot: {screenshot}")


def test_terminal_shows_the_top_findings(result):
    console = Console(record=True, width=160)
    print_profile(result, console)
    text = console.export_text()
    assert "top bottlenecks" in text and "slowest kernels" in text
    assert result["findings"][0]["title"] in text


def test_bench_table_shows_paths_literally():
    """Paths a user typed may hold rich markup ('[red]'); tables show them as typed."""
    result = {
        "command": "kiln bench [red]m.onnx",
        "model": "[bold]m.onnx",
        "date": "2025-01-01T00:00:00+00:00",
        "machine": {"cpu": "cpu", "cores": 2},
        "versions": {"kiln": kiln.__version__},
        "baseline": "ort",
        "batch": 1,
        "rounds": 1,
        "runs_per_round": 1,
        "engines": {},
    }
    console = Console(record=True, width=160)
    print_bench(result, console)
    text = console.export_text()
    assert "kiln bench [red]m.onnx" in text and "kiln bench [bold]m.onnx" in text
