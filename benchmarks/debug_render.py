"""How long `kiln debug`'s page takes to draw a graph in headless Chromium.

    python benchmarks/debug_render.py [--model zoo:bert-base] [--deep-layers 30] [--repeats 5]
        [--out results/debug_render.json]

For each model the app is served in-process (the model loaded first, off the clock) and a
fresh page is opened --repeats times; the figure is the time from navigation to the page's
`data-ready` marker, which it sets once both graphs are drawn in SVG (every node: nothing is
collapsed below 3,000 nodes; the page keeps in the DOM only the nodes in and near the view, so
the first view, the graph's width from its top, draws a few dozen boxes). It is measured twice:
by the page itself (`performance.now()` at the marker, from navigation start) and by the driver
(page.goto → the marker seen). Then "fit" puts every node in view (boxes without labels) and
that is timed to the next painted frame (`whole_ms`). The first visit also builds the graphs'
JSON on the server; later ones are served it from memory.

Models: zoo:bert-base (its original graph) and, for a graph past 1,000 nodes, the zoo's BERT
built `--deep-layers` layers deep (tiny widths: only the node count matters here). The
default run takes about a minute.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import shutil
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import onnx
from _results import Recorder, add_arguments, row  # benchmarks/ is the script's own directory
from playwright.sync_api import sync_playwright

from kiln.debug.app import create_app
from kiln.debug.session import DebugSession
from kiln.hardware import cpu_info
from kiln.serve.server import http_server
from kiln.zoo import bert

VIEWPORT = {"width": 1600, "height": 1000}
# "fit" on both panes: every node in view (as boxes: labels are unreadable at that scale),
# timed to the next painted frame.
WHOLE = """async () => {
  const t = performance.now();
  for (const pane of Object.values(panes)) pane.fit(true);
  await new Promise((done) => requestAnimationFrame(() => setTimeout(done)));
  return { whole_ms: Math.round(performance.now() - t),
           boxes_whole: document.querySelectorAll("#pane-original g.n").length };
}"""


def deep_bert(layers: int, where: Path) -> str:
    """The zoo's BERT with `layers` encoder layers at bert-tiny's widths, as an .onnx file."""
    path = where / f"bert-{layers}-layers.onnx"
    cfg = dataclasses.replace(bert.TINY, layers=layers)
    onnx.save(bert.build(cfg, "bert-deep", {"batch": 1, "seq": 16}), str(path))
    return str(path)


def serve(model: str) -> tuple[str, DebugSession, object]:
    session = DebugSession(model, profile_runs=0)  # the profile is not what is timed
    ready = threading.Event()
    server = http_server(create_app(session), on_ready=ready.set)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    if not ready.wait(60):
        raise SystemExit("the app did not start")
    return f"http://127.0.0.1:{sock.getsockname()[1]}", session, server


def measure(browser, url: str, repeats: int) -> dict:
    visits = []
    for _ in range(repeats):
        page = browser.new_page(viewport=VIEWPORT)
        errors: list[str] = []
        page.on("pageerror", lambda exc, errors=errors: errors.append(str(exc)))
        start = time.perf_counter()
        page.goto(url)
        page.wait_for_selector("body[data-ready]", state="attached", timeout=60_000)
        driver_ms = (time.perf_counter() - start) * 1e3
        boxes = page.locator("#pane-original g.n").count()
        visits.append({
            "page_ms": float(page.get_attribute("body", "data-ready")),
            "driver_ms": round(driver_ms, 1),
            "boxes_in_view": boxes,
            **page.evaluate(WHOLE),
            "errors": errors,
        })  # fmt: skip
        page.close()
    warm = visits[1:] or visits
    return {
        "visits": visits,
        "first_page_ms": visits[0]["page_ms"],
        "median_page_ms": statistics.median(v["page_ms"] for v in warm),
        "median_driver_ms": statistics.median(v["driver_ms"] for v in warm),
        "max_page_ms": max(v["page_ms"] for v in visits),
        "median_whole_ms": statistics.median(v["whole_ms"] for v in warm),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="zoo:bert-base")
    parser.add_argument("--deep-layers", type=int, default=30, help="0: skip the deep BERT")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="results/debug_render.json")
    add_arguments(parser)
    args = parser.parse_args()
    recorder = Recorder("debug_render")
    chromium = shutil.which("chromium")
    if chromium is None:
        raise SystemExit("no chromium on PATH (apt-get install -y chromium)")
    cpu = cpu_info()
    result = {
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "machine": {
            "cpu": cpu.model,
            "cores": cpu.logical_cores,
            "browser": chromium,
            "viewport": VIEWPORT,
        },
        "budget_ms": 3000,
        "models": [],
    }
    with tempfile.TemporaryDirectory() as where, sync_playwright() as p:
        models = [args.model]
        if args.deep_layers > 0:
            models.append(deep_bert(args.deep_layers, Path(where)))
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        for model in models:
            load = time.perf_counter()
            url, session, server = serve(model)
            load_s = time.perf_counter() - load
            figures = measure(browser, url, args.repeats)
            server.should_exit = True
            nodes = sum(1 for _ in session.original.graph)
            entry = {"model": Path(model).name if model.endswith(".onnx") else model,
                     "nodes": nodes, "load_s": round(load_s, 2), **figures}  # fmt: skip
            result["models"].append(entry)
            print(
                f"{entry['model']}: {nodes} nodes, ready in {entry['median_page_ms']:.0f} ms "
                f"(median of {len(figures['visits']) - 1 or 1} visits; first "
                f"{entry['first_page_ms']:.0f} ms, driver {entry['median_driver_ms']:.0f} ms); "
                f"every node in view {entry['median_whole_ms']:.0f} ms"
            )
        browser.close()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result['command']} on {cpu.model} ({cpu.logical_cores} cores) → {out}")
    recorder.write([
        row(f"{entry['model']} ({entry['nodes']} nodes): page ready", entry["median_page_ms"],
            "ms", verdict="within 3 s" if entry["median_page_ms"] <= 3000 else "over 3 s",
            model=entry["model"])
        for entry in result["models"]
    ], result, args.results)  # fmt: skip


if __name__ == "__main__":
    main()
