"""Screenshots for the docs, taken by the docs build: a profile report and the debugger's page,
both of zoo:bert-tiny, in the headless Chromium the browser tests use (Debian's, driven by
Playwright; no browser download).

The pictures are made, not kept in git: without Chromium or Playwright the build stops with
one line saying what to install (the pages show them).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

SHOTS = {"profile": "assets/profile-report.png", "debugger": "assets/debugger.png"}
VIEWPORT = {"width": 1400, "height": 900}
TIMEOUT_S = 180


class BrowserMissing(Exception):
    """Chromium or Playwright is not installed, and CI=true says it must be."""


def take(into: Path) -> dict[str, Path] | None:
    """The screenshots written under `into` (by SHOTS' names); BrowserMissing without one."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    if chromium is None or sync_playwright is None:
        raise BrowserMissing(
            "the docs' screenshots need Chromium and Playwright: apt-get install chromium; "
            "pip install -e '.[test]'"
        )
    work = Path(tempfile.mkdtemp(prefix="kiln-docs-"))
    try:
        artifact = _compile(work)
        report = _profile(artifact, work)
        shots = {name: into / path for name, path in SHOTS.items()}
        for path in shots.values():
            path.parent.mkdir(parents=True, exist_ok=True)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            try:
                _shoot_report(browser, report, shots["profile"])
                _shoot_debugger(browser, artifact, shots["debugger"])
            finally:
                browser.close()
        return shots
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _kiln(*args: str, cwd: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kiln", *args],
        cwd=cwd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"kiln {' '.join(args)} failed: {done.stderr[-2000:]}")


def _env() -> dict[str, str]:
    # The same graph on every machine: fusions are not timed against their parts.
    return {**os.environ, "KILN_FUSED_OPS": os.environ.get("KILN_FUSED_OPS", "fuse")}


def _compile(work: Path) -> Path:
    _kiln("optimize", "zoo:bert-tiny", "-o", "bert-tiny.kiln", "--rounds", "0", cwd=work)
    return work / "bert-tiny.kiln"


def _profile(artifact: Path, work: Path) -> Path:
    _kiln("profile", artifact.name, "-o", "report.html", "--runs", "10", "--rounds", "2", cwd=work)
    return work / "report.html"


def _shoot_report(browser, report: Path, path: Path) -> None:
    page = browser.new_page(viewport=VIEWPORT)
    page.goto(report.resolve().as_uri())
    page.wait_for_selector("#roofline .main-svg", timeout=TIMEOUT_S * 1000)
    page.screenshot(path=str(path))
    page.close()


def _shoot_debugger(browser, artifact: Path, path: Path) -> None:
    args = [artifact.name, "--port", "0", "--no-open", "--json", "--profile-runs", "5"]
    log = artifact.parent / "debug.log"
    with log.open("w") as stderr:
        server = subprocess.Popen(
            [sys.executable, "-m", "kiln", "debug", *args],
            cwd=artifact.parent, env=_env(), stdout=subprocess.PIPE, stderr=stderr, text=True,
        )  # fmt: skip
    try:
        line = server.stdout.readline() if server.stdout else ""
        if not line:
            raise RuntimeError(f"kiln debug ended before it served: {log.read_text()[-2000:]}")
        page = browser.new_page(viewport=VIEWPORT)
        page.goto(json.loads(line)["url"])
        page.wait_for_selector("body[data-ready]", state="attached", timeout=TIMEOUT_S * 1000)
        # A fused attention node selected: its original nodes light up on the left.
        page.fill("#pane-compiled input.search", "Attention")
        page.press("#pane-compiled input.search", "Enter")
        page.locator("#pane-compiled g.n.hit", has_text="Attention").first.click()
        page.wait_for_selector("#details ul.origin", timeout=TIMEOUT_S * 1000)
        page.screenshot(path=str(path))
        page.close()
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


if __name__ == "__main__":
    docs = Path(__file__).resolve().parents[1]
    taken = take(docs)
    print("\n".join(
        str(p) for p in taken.values()))  # fmt: skip
