"""`kiln debug` in a real browser: Debian's Chromium driven by Playwright (no browser download).

Skipped where Chromium or Playwright is missing, except under CI=true, where that fails."""

from __future__ import annotations

import io
import json
import os
import shutil
import socket
import threading

import httpx
import numpy as np
import pytest
from test_compare import kiln_cli
from test_debug_app import independent_run
from test_profile import PEAKS

import kiln
from kiln.debug.app import create_app
from kiln.debug.session import DebugSession
from kiln.serve.server import http_server

CI = os.environ.get("CI") == "true"


def require(what: str, found: object) -> None:
    if found:
        return
    if CI:
        pytest.fail(f"{what} is missing, and CI=true: the browser test must run in CI")
    pytest.skip(f"{what} is missing")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """bert-tiny compiled vs its original, served in-process on a free port."""
    where = tmp_path_factory.mktemp("browser")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KILN_HOME", str(where / "home"))
        assert kiln_cli("zoo", "export", "bert-tiny", "-o", "bert.onnx", cwd=where).returncode == 0
        kiln.compile(where / "bert.onnx", where / "bert.kiln", rounds=0)
    session = DebugSession(str(where / "bert.kiln"), peaks=PEAKS, profile_runs=5)
    ready = threading.Event()
    server = http_server(create_app(session), on_ready=ready.set)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    assert ready.wait(60), "the app did not start"
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", session, where
    server.should_exit = True
    thread.join(30)
    sock.close()


def test_click_a_fused_attention_break_step_and_read_numpys_statistics(served, tmp_path):
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    require("playwright", sync_playwright)
    chromium = shutil.which("chromium")
    require("chromium", chromium)
    url, session, where = served
    fused = next(n for n in session.main.model.graph if n.op_type == "Attention")
    origin = session.main.origin(fused)["origin"]
    tensor = fused.outputs[0].name
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        errors: list[str] = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(url)
        page.wait_for_selector("body[data-ready]", state="attached")

        page.fill("#pane-compiled input.search", "Attention")  # found, centred in view
        page.press("#pane-compiled input.search", "Enter")
        page.locator("#pane-compiled g.n.hit", has_text="Attention").first.click()
        page.wait_for_selector("#details ul.origin")
        assert page.locator("#details ul.origin a.node").all_inner_texts() == origin
        assert page.locator("#pane-original g.n.link").count() == len(origin)

        page.click("#details button.bp-toggle")
        page.wait_for_selector("#pane-compiled g.n.bp")
        page.click("#run")
        position = session.stepper.order.index(fused.name)
        page.wait_for_selector(f'#exec-state[data-position="{position}"]', state="attached")
        assert page.locator("#pane-compiled g.n.cur", has_text="Attention").count() == 1
        page.click("#step")
        main = f'#tensor[data-name="{tensor}"] [data-side="main"]'
        page.wait_for_selector(f'{main} [data-stat="mean"]')

        values = httpx.get(f"{url}/api/tensor.npy", params={"name": tensor})  # the page's own
        raw = np.load(io.BytesIO(values.content))
        shown = {
            stat: float(page.get_attribute(f'{main} [data-stat="{stat}"]', "data-value"))
            for stat in ("min", "max", "mean", "std")
        }
        assert shown == {"min": float(raw.min()), "max": float(raw.max()),
                         "mean": float(np.mean(raw)), "std": float(np.std(raw))}  # fmt: skip
        assert json.loads(page.inner_text(f'{main} [data-stat="shape"]')) == list(raw.shape)
        alone = independent_run(where / "bert.kiln" / "model.onnx", tensor, session.feeds)
        np.testing.assert_allclose(raw, alone, rtol=1e-5, atol=1e-6)  # the engine's, not ours
        other = page.get_attribute('#tensor [data-side="against"] [data-stat="mean"]', "data-value")
        assert float(other) == pytest.approx(shown["mean"], abs=1e-5)  # the original's, beside

        page.screenshot(path=str(tmp_path / "kiln-debug.png"))
        browser.close()
    assert (tmp_path / "kiln-debug.png").stat().st_size > 0
    assert errors == []
