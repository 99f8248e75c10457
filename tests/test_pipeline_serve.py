"""`kiln serve` of a pipeline artifact: one KServe v2 model, bytes in and each query's result
as JSON out, answered as the plain function answers; its stages' statistics in /stats."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from test_pipeline_compile import WIDTH, _matmul
from test_serve import _start, _stop

import kiln
from kiln.pipeline import compile_pipeline, load_function

pytestmark = pytest.mark.timeout(300)

GLUE = '''
import numpy as np

def label(data, *, embed, cls):
    """bytes of 64 float32 → the label and a rounded score."""
    x = np.frombuffer(data, np.float32).reshape(1, 64)
    (logits,) = cls.run(None, {"x": x})
    if x.sum() < -20:  # an early exit: the embedding is not needed
        return {"label": None}
    (y,) = embed.run(None, {"x": x})
    return {"label": int(logits.argmax()), "norm": round(float(np.linalg.norm(y)), 2)}

def queries():
    rng = np.random.default_rng(2)
    for i in range(8):
        x = rng.standard_normal((1, 64)).astype(np.float32)
        x[0, i % 4] += 12.0 if i % 3 else -40.0
        yield x.tobytes()
'''


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    (root / "glue.py").write_text(textwrap.dedent(GLUE))
    rng = np.random.default_rng(3)
    models = {
        "embed": str(_matmul(root / "embed.onnx", rng.standard_normal((WIDTH, 8), np.float32))),
        "cls": str(_matmul(root / "cls.onnx", rng.standard_normal((WIDTH, 4), np.float32))),
    }
    out = root / "label.kiln"
    compile_pipeline(f"{root}/glue.py:label", models, f"{root}/glue.py:queries", out)
    return root, models, out


def test_a_served_pipeline_answers_as_the_plain_function(served) -> None:
    root, models, artifact = served
    function = load_function(f"{root}/glue.py:label")
    queries = list(load_function(f"{root}/glue.py:queries")())
    sessions = {name: kiln.Session(str(artifact / "stages" / f"{name}.kiln")) for name in models}
    expected = [json.loads(json.dumps(function(q, **sessions))) for q in queries]
    server = _start(root, str(artifact))
    try:
        client = triton.InferenceServerClient(server.url)
        meta = client.get_model_metadata("label")
        assert meta["inputs"] == [{"name": "input", "datatype": "BYTES", "shape": [-1]}]
        assert meta["outputs"] == [{"name": "output", "datatype": "BYTES", "shape": [-1]}]

        def ask(query: bytes) -> object:
            tensor = triton.InferInput("input", [1], "BYTES")
            tensor.set_data_from_numpy(np.array([query], dtype=object))
            (answer,) = client_for().infer("label", [tensor]).as_numpy("output")
            return json.loads(answer)

        def client_for() -> triton.InferenceServerClient:
            return triton.InferenceServerClient(server.url)

        with ThreadPoolExecutor(4) as pool:  # concurrent requests: merged into streams
            answers = list(pool.map(ask, queries))
        both = triton.InferInput("input", [2], "BYTES")
        both.set_data_from_numpy(np.array(queries[:2], dtype=object))
        two = [json.loads(a) for a in client.infer("label", [both]).as_numpy("output")]
        (stats,) = client.get_inference_statistics("label")["model_stats"]
        runtime = httpx.get(f"{server.base}/v2/models/label/runtime").json()
    finally:
        _stop(server)
    assert answers == expected and two == expected[:2]
    assert any(a["label"] is None for a in answers), "the early exit is taken by some queries"
    assert stats["inference_count"] == len(queries) + 2
    assert runtime["queries"] == len(queries) + 2
    assert runtime["stages"]["cls"]["calls"] == len(queries) + 2  # every query asks cls
    assert 0 < runtime["stages"]["embed"]["calls"] < runtime["stages"]["cls"]["calls"]


def test_concurrent_requests_run_together_and_the_human_start_up_names_the_model(served):
    root, _models, artifact = served
    queries = list(load_function(f"{root}/glue.py:queries")())
    cmd = [sys.executable, "-m", "kiln", "serve", str(artifact), "--port", "0",
           "--grpc-port", "-1", "--max-delay-ms", "50"]  # fmt: skip
    proc = subprocess.Popen(cmd, env={**os.environ, "KILN_HOME": str(root)}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        lines = _lines_until(proc, "Ctrl-C to stop")
        (serving,) = [line for line in lines if line.startswith("serving 'label'")]
        url = serving.split(" on ")[1].split("/v2/")[0]

        def ask(query: bytes) -> int:
            tensor = triton.InferInput("input", [1], "BYTES")
            tensor.set_data_from_numpy(np.array([query], dtype=object))
            triton.InferenceServerClient(url.removeprefix("http://")).infer("label", [tensor])
            return 1

        with ThreadPoolExecutor(8) as pool:  # at once, within the 50 ms a batch waits
            assert sum(pool.map(ask, queries)) == len(queries)
        stats = httpx.get(f"{url}/v2/models/label/stats").json()["model_stats"][0]
    finally:
        proc.terminate()
        proc.wait(30)
    sizes = [s["batch_size"] for s in stats["batch_stats"]]
    assert max(sizes) > 1, f"every request ran alone: {sizes}"


def _lines_until(proc: subprocess.Popen, marker: str) -> list[str]:
    """The server's output lines up to the one holding `marker` (the event: it serves)."""
    lines: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            lines.append(line.strip())
            if marker in line:
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(120)  # a safety net: the marker line is the event
    assert lines and marker in lines[-1], lines
    return lines
