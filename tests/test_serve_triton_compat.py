"""`kiln serve` keeps Triton's promises where an operator's tooling relies on them: the
max_batch_size /config advertises is enforced, statistics count the executions that ran, and
/metrics carries Triton's metric names with their meaning."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import onnx
import pytest
import tritonclient.http as triton
from fastapi.testclient import TestClient
from onnx import TensorProto, helper
from prometheus_client.parser import text_string_to_metric_families
from test_serve import BERT, RESNET, Server, _start, _stop
from tritonclient.utils import InferenceServerException

from kiln import zoo
from kiln.runtime import Session
from kiln.serve.app import create_app, create_models_app
from kiln.serve.metrics import TritonMetrics
from kiln.serve.models import ModelSet
from kiln.serve.repository import Repository

MAX_BATCH = 4  # --max-batch of the servers here


@pytest.fixture(scope="module")
def resnet(tmp_path_factory) -> Server:
    home = tmp_path_factory.mktemp("compat-home")
    server = _start(home, f"zoo:{RESNET}", "--max-batch", str(MAX_BATCH))
    yield server
    _stop(server)


def _image(batch: int) -> triton.InferInput:
    data = np.random.default_rng(batch).random((batch, 3, 32, 32), dtype=np.float32)
    tensor = triton.InferInput("input", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data, binary_data=True)
    return tensor


def test_a_request_over_max_batch_size_is_refused_and_memory_stays_bounded(
    resnet: Server,
) -> None:
    client = triton.InferenceServerClient(resnet.url)
    assert client.get_model_config(RESNET)["max_batch_size"] == MAX_BATCH
    client.infer(RESNET, [_image(MAX_BATCH)])  # the largest batch advertised is served
    before = resnet.metric("process_resident_memory_bytes")
    oversized = _image(1000)  # 12 MB: its activations would take hundreds of MB
    for _ in range(20):
        with pytest.raises(InferenceServerException) as refused:
            client.infer(RESNET, [oversized])
        assert refused.value.status() == "400"
        assert f"takes 1 to {MAX_BATCH} per request" in refused.value.message()
    after = resnet.metric("process_resident_memory_bytes")
    assert after <= 1.1 * before, (before, after)


def test_a_request_of_batch_0_is_refused_and_runs_nothing(resnet: Server) -> None:
    ran = _engine_runs(resnet, RESNET)
    empty = {"inputs": [{"name": "input", "shape": [0, 3, 32, 32], "datatype": "FP32", "data": []}]}
    answer = httpx.post(f"{resnet.base}/v2/models/{RESNET}/infer", json=empty)
    assert answer.status_code == 400, answer.text
    assert "input 'input' has batch size 0" in answer.text
    assert f"takes 1 to {MAX_BATCH} per request" in answer.text
    assert _engine_runs(resnet, RESNET) == ran


def _batch_one_model(path: Path) -> Path:
    """x [1, 4] → relu → y [1, 4]: no batch axis (max_batch_size 0), each request its own
    execution however the batcher groups them."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "relu", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _engine_runs(server: Server, model: str) -> int:
    """The executions the model's session ran, by its own record (Kiln's runtime extension)."""
    stats = httpx.get(f"{server.base}/v2/models/{model}/runtime").json()
    return sum(bucket["runs"] for bucket in stats["buckets"].values())


def test_statistics_count_the_executions_that_ran(tmp_path) -> None:
    requests = 8
    model = _batch_one_model(tmp_path / "relu.onnx")
    # The batcher hands all 8 to the session at once (the delay is never waited out); the
    # session, with no batch axis to merge them on, runs each alone.
    server = _start(tmp_path, str(model), "--max-batch", str(requests), "--max-delay-ms", "60000")
    try:

        def infer(seed: int) -> None:
            client = triton.InferenceServerClient(server.url)
            tensor = triton.InferInput("x", [1, 4], "FP32")
            tensor.set_data_from_numpy(np.full((1, 4), seed, np.float32))
            client.infer("relu", [tensor])

        with ThreadPoolExecutor(requests) as pool:
            list(pool.map(infer, range(requests)))
        client = triton.InferenceServerClient(server.url)
        (stats,) = client.get_inference_statistics("relu")["model_stats"]
        ran = _engine_runs(server, "relu")
    finally:
        _stop(server)
    assert ran == requests
    assert stats["execution_count"] == ran
    assert stats["inference_count"] == requests  # one per request: no batch axis
    (batch,) = stats["batch_stats"]
    assert batch["batch_size"] == 1
    for phase in ("compute_input", "compute_infer", "compute_output"):
        assert batch[phase]["count"] == ran, phase
        assert batch[phase]["ns"] > 0, phase


def test_triton_metric_names_read_by_a_prometheus_parser(tmp_path) -> None:
    session = Session(f"zoo:{RESNET}")
    data = np.zeros((2, 3, 32, 32), np.float32)
    body = {"inputs": [{"name": "input", "shape": list(data.shape), "datatype": "FP32",
                        "data": data.ravel().tolist()}]}  # fmt: skip
    answered, batch = 3, 2
    with TestClient(create_app(session, "r", max_batch=MAX_BATCH)) as client:
        for _ in range(answered):  # one at a time: one execution each
            assert client.post("/v2/models/r/infer", json=body).status_code == 200
        assert client.post("/v2/models/r/infer", json={"inputs": []}).status_code == 400
        text = client.get("/metrics").text
        (stats,) = client.get("/v2/models/r/stats").json()["model_stats"]
    read = {
        family.name: {(s.labels["model"], s.labels["version"]): s.value for s in family.samples}
        for family in text_string_to_metric_families(text)
        if family.name.startswith("nv_inference_")
    }
    assert {name: list(values) for name, values in read.items()} == {
        f"nv_inference_{key}": [("r", "1")] for key in TritonMetrics.NAMES
    }
    value = {name[len("nv_inference_") :]: values[("r", "1")] for name, values in read.items()}
    assert value["request_success"] == answered and value["request_failure"] == 1
    assert value["count"] == answered * batch and value["exec_count"] == answered
    phases = stats["inference_stats"]
    for key, phase in [("request", "success"), ("queue", "queue"), ("compute_input",
                       "compute_input"), ("compute_infer", "compute_infer"),
                       ("compute_output", "compute_output")]:  # fmt: skip
        assert value[f"{key}_duration_us"] == phases[phase]["ns"] // 1000, key
    assert value["request_duration_us"] >= value["compute_infer_duration_us"] > 0
    # Every family served is documented, by the name a scraper stores it under.
    documented = (Path(__file__).parents[1] / "docs/reference/metrics.md").read_text()
    for family in text_string_to_metric_families(text):
        own = family.name.startswith("process_") or family.name.endswith("_created")
        names = [f"`{family.name}`", f"`{family.name}_total`"]  # the parser drops _total
        assert own or any(n in documented for n in names), f"{family.name} is not documented"


def test_stats_describe_the_loaded_model_and_metrics_the_servers_life(tmp_path) -> None:
    (tmp_path / "relu/1").mkdir(parents=True)
    _batch_one_model(tmp_path / "relu/1/model.onnx")
    models = ModelSet(repository=Repository(tmp_path))
    models.load_repository()
    x = {"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
    with TestClient(create_models_app(models)) as client:
        for _ in range(2):  # answered, then unloaded and loaded again
            assert client.post("/v2/models/relu/infer", json=x).status_code == 200
            assert client.post("/v2/repository/models/relu/unload").status_code == 200
            assert client.post("/v2/repository/models/relu/load").status_code == 200
        (stats,) = client.get("/v2/models/relu/stats").json()["model_stats"]
        metrics = client.get("/metrics").text
    assert stats["inference_stats"]["success"]["count"] == 0  # this load answered none
    assert 'nv_inference_request_success{model="relu",version="1"} 2' in metrics
    documented = (Path(__file__).parents[1] / "docs/reference/metrics.md").read_text()
    assert "always agree" not in documented
    assert "the statistics extension starts again at 0" in " ".join(documented.split())


def test_a_model_that_fails_to_load_is_reported_once_at_start_up(tmp_path) -> None:
    repository = tmp_path / "repository"
    (repository / "broken" / "1").mkdir(parents=True)
    (repository / "broken" / "1" / "model.onnx").write_text("not a model")
    (repository / "relu" / "1").mkdir(parents=True)
    _batch_one_model(repository / "relu" / "1" / "model.onnx")
    command = [sys.executable, "-m", "kiln", "serve", f"--model-repository={repository}",
               "--port", "0", "--grpc-port", "-1"]  # fmt: skip
    env = {**os.environ, "KILN_HOME": str(tmp_path)}
    server = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True)
    said = []
    try:  # the start-up lines, up to the last one: the event (pytest-timeout the safety net)
        for line in iter(server.stderr.readline, ""):
            said.append(line)
            if line.startswith("(Ctrl-C to stop"):
                break
    finally:
        server.send_signal(signal.SIGINT)
        server.communicate(timeout=30)
    text = "".join(said)
    assert text.count("is a text file, not an ONNX model") == 1, text
    assert "'broken' is UNAVAILABLE" in text and "serving 'relu'" in text


def test_a_bad_token_id_or_empty_sequence_is_named_by_its_input_and_range() -> None:
    session = Session(f"zoo:{BERT}")
    vocabulary = zoo.build(BERT).graph.initializer  # the word table's rows, from the model
    rows = next(t.dims[0] for t in vocabulary if "word_embeddings" in t.name)

    def body(ids: np.ndarray) -> dict:
        feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids),
                 "token_type_ids": np.zeros_like(ids)}  # fmt: skip
        return {"inputs": [{"name": n, "shape": list(a.shape), "datatype": "INT64",
                            "data": a.ravel().tolist()} for n, a in feeds.items()]}  # fmt: skip

    with TestClient(create_app(session, BERT)) as client:

        def refusal(ids: np.ndarray) -> str:
            answer = client.post(f"/v2/models/{BERT}/infer", json=body(ids))
            assert answer.status_code == 400, answer.text
            return answer.json()["error"]

        for bad in (rows, -5):  # one past the end; negative (the engine reads from the end)
            said = refusal(np.array([[1, bad]], np.int64))
            assert said == (
                f"input 'input_ids' holds id {bad}; the model takes ids 0 to {rows - 1} (its "
                f"embedding table has {rows} rows)"
            )
        most = session.limits["seq"].limit
        said = refusal(np.zeros((1, 0), np.int64))
        assert "input 'input_ids' has shape [1, 0]" in said and f"1 to {most}" in said
        assert "node '" not in said
        ok = client.post(f"/v2/models/{BERT}/infer", json=body(np.array([[0, rows - 1]])))
        assert ok.status_code == 200
