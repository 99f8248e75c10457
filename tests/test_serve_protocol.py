"""`kiln serve` speaks the protocol extensions Triton's clients call: `/config` as Triton's
ModelConfig, `/stats` as Triton's statistics, `GET v2` naming exactly those it serves; and a
lone request is not held back for company by default."""

from __future__ import annotations

import functools
import importlib.util
import sys
import time
import types
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tritonclient
import tritonclient.http as triton
from fastapi.testclient import TestClient
from google.protobuf import json_format
from onnx import helper
from string_models import strings_model
from test_serve import BERT, RESNET, Server, _post, _start, _stop
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from kiln import zoo
from kiln.runtime import Session
from kiln.serve.app import create_app
from kiln.serve.protocol import model_config
from kiln.serve.serving import batcher_settings

SERVED = {"binary_tensor_data", "model_configuration", "statistics"}


@functools.cache
def _protos() -> tuple[types.ModuleType, types.ModuleType]:
    """tritonclient's model_config_pb2 and service_pb2 (Triton's own schemas). Loaded from
    their files when `tritonclient.grpc` cannot be imported: it needs grpcio, which the HTTP
    tests do not."""
    try:
        from tritonclient.grpc import model_config_pb2, service_pb2

        return model_config_pb2, service_pb2
    except (ImportError, RuntimeError):
        pass
    root = Path(tritonclient.__path__[0]) / "grpc"

    def load(name: str) -> types.ModuleType:
        spec = importlib.util.spec_from_file_location(f"tritonclient.grpc.{name}", root / name)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    config_pb2 = load("model_config_pb2.py")
    # service_pb2 imports model_config_pb2 through its package: lend it one just for that.
    package = types.ModuleType("tritonclient.grpc")
    package.model_config_pb2 = config_pb2
    sys.modules["tritonclient.grpc"] = package
    try:
        return config_pb2, load("service_pb2.py")
    finally:
        del sys.modules["tritonclient.grpc"]


def _as_model_config(config: dict[str, Any]) -> Any:
    """Triton's ModelConfig message; ParseDict refuses an unknown field or a wrong type."""
    return json_format.ParseDict(config, _protos()[0].ModelConfig())


def _triton_tensors(values: Any, batched: bool) -> list[dict[str, Any]]:
    """What Triton's config says of the model's own inputs or outputs (from the ONNX file,
    types named by tritonclient): the batch dim left out, -1 for a dynamic dim."""
    out = []
    for value in values:
        kind = value.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in kind.shape.dim]
        dtype = np_to_triton_dtype(helper.tensor_dtype_to_np_dtype(kind.elem_type))
        out.append({"name": value.name, "data_type": f"TYPE_{dtype}",
                    "dims": dims[1:] if batched else dims})  # fmt: skip
    return out


def _tensors(message: Any) -> list[dict[str, Any]]:
    data_type = _protos()[0].DataType.Name
    return [{"name": t.name, "data_type": data_type(t.data_type), "dims": list(t.dims)}
            for t in message]  # fmt: skip


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> Iterator[Server]:
    server = _start(tmp_path_factory.mktemp("serve-home"), f"zoo:{BERT}")  # every default
    yield server
    _stop(server)


def test_config_is_tritons_model_config_of_the_model_and_the_batcher(bert: Server) -> None:
    client = triton.InferenceServerClient(bert.url)
    config = client.get_model_config(BERT)
    assert httpx.get(f"{bert.base}/v2/models/{BERT}/versions/1/config").json() == config
    parsed = _as_model_config(config)
    model = zoo.build(BERT)
    engine = ("onnxruntime_onnx", "onnxruntime")  # zoo models run on ONNX Runtime by default
    assert (parsed.name, parsed.platform, parsed.backend) == (BERT, *engine)
    assert parsed.max_batch_size == batcher_settings(f"zoo:{BERT}", None, None)[0]
    assert _tensors(parsed.input) == _triton_tensors(model.graph.input, batched=True)
    assert _tensors(parsed.output) == _triton_tensors(model.graph.output, batched=True)
    kinds = _protos()[0].ModelInstanceGroup.Kind
    assert [(kinds.Name(g.kind), g.count) for g in parsed.instance_group] == [("KIND_CPU", 1)]
    assert parsed.HasField("dynamic_batching")


def test_a_lone_request_is_not_held_by_default(bert: Server, tmp_path) -> None:
    config = httpx.get(f"{bert.base}/v2/models/{BERT}/config").json()
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 0
    assert batcher_settings(f"zoo:{RESNET}", None, None)[1] == 0.0
    # A delay is a choice: kiln tune's, recorded in the artifact, and the flag's above it.
    from kiln.compiler.api import build, load_source, save_result
    from kiln.config import CompileConfig

    result, _ = build(load_source(f"zoo:{RESNET}"), CompileConfig())
    tuned = {"tune": {"serving": {"max_batch": 4, "max_delay_ms": 2.0}}}
    artifact = str(save_result(result, tmp_path / "tuned.kiln", tuned).path)
    assert batcher_settings(artifact, None, None) == (4, 2.0)
    assert batcher_settings(artifact, None, 0.0) == (4, 0.0)


def test_v2_lists_exactly_the_extensions_served(bert: Server) -> None:
    client = triton.InferenceServerClient(bert.url)
    extensions = client.get_server_metadata()["extensions"]
    assert set(extensions) == SERVED and len(extensions) == len(SERVED)
    # Each one answers (binary_tensor_data: the other tests infer through it).
    assert client.get_model_config(BERT)["name"] == BERT
    assert client.get_inference_statistics(BERT)["model_stats"][0]["name"] == BERT


def test_an_unknown_model_or_version_is_404_naming_it(bert: Server) -> None:
    for path in ["nope/config", "nope/versions/1/config", "nope/stats", "nope/versions/1/stats"]:
        response = httpx.get(f"{bert.base}/v2/models/{path}")
        assert response.status_code == 404, path
        assert response.json() == {"error": f"unknown model 'nope'; this server serves '{BERT}'"}
    for path in ["config", "stats"]:
        response = httpx.get(f"{bert.base}/v2/models/{BERT}/versions/7/{path}")
        assert response.status_code == 404 and "no version '7'" in response.json()["error"]
    client = triton.InferenceServerClient(bert.url)
    with pytest.raises(InferenceServerException, match="unknown model 'nope'"):
        client.get_model_config("nope")
    with pytest.raises(InferenceServerException, match="unknown model 'nope'"):
        client.get_inference_statistics("nope")


FULL = 8  # --max-batch of the stats server


def _infer(url: str, batch: int) -> None:
    client = triton.InferenceServerClient(url)  # one per thread: not thread-safe
    data = np.random.default_rng(batch).random((batch, 3, 32, 32), dtype=np.float32)
    tensor = triton.InferInput("input", list(data.shape), "FP32")
    tensor.set_data_from_numpy(data)
    assert client.infer(RESNET, [tensor]).as_numpy("logits").shape[0] == batch


def test_stats_count_the_requests_samples_and_batches_sent(tmp_path) -> None:
    # A long delay and batches the requests fill exactly: each batch runs when its last request
    # arrives (the delay is never waited out), so the batches are known before they run.
    server = _start(tmp_path, f"zoo:{RESNET}", "--max-batch", str(FULL), "--max-delay-ms", "60000")
    rounds = [[FULL], [FULL], [1] * FULL, [2] * (FULL // 2)]  # alone, alone, together, together
    try:
        since_ms = time.time_ns() // 1_000_000
        with ThreadPoolExecutor(FULL) as pool:
            for sizes in rounds:
                list(pool.map(functools.partial(_infer, server.url), sizes))
        assert _post(server, '{"inputs": []}', RESNET).status_code == 400
        until_ms = time.time_ns() // 1_000_000
        client = triton.InferenceServerClient(server.url)
        response = client.get_inference_statistics(RESNET)
        for path in ["stats", f"{RESNET}/stats", f"{RESNET}/versions/1/stats"]:
            assert httpx.get(f"{server.base}/v2/models/{path}").json() == response, path
        config = client.get_model_config(RESNET)
        received = server.metric("kiln_requests_total")
    finally:
        _stop(server)
    json_format.ParseDict(response, _protos()[1].ModelStatisticsResponse())
    (stats,) = response["model_stats"]
    requests, samples = sum(map(len, rounds)), sum(map(sum, rounds))
    assert (stats["name"], stats["version"]) == (RESNET, "1")
    assert stats["inference_count"] == samples
    assert stats["execution_count"] == samples // FULL == len(rounds)  # every batch full
    assert stats["execution_count"] <= stats["inference_count"]
    phases = stats["inference_stats"]
    assert phases["success"]["count"] == requests and phases["fail"]["count"] == 1
    assert phases["success"]["count"] + phases["fail"]["count"] == received
    parts = ["queue", "compute_input", "compute_infer", "compute_output"]
    assert {phases[p]["count"] for p in parts} == {requests}
    assert phases["success"]["ns"] >= sum(phases[p]["ns"] for p in parts)  # parts of a whole
    batches = stats["batch_stats"]
    assert [b["batch_size"] for b in batches] == [FULL]
    assert sum(b["batch_size"] * b["compute_infer"]["count"] for b in batches) == samples
    assert sum(b["compute_infer"]["count"] for b in batches) == stats["execution_count"]
    assert since_ms <= stats["last_inference"] <= until_ms
    assert config["max_batch_size"] == FULL  # the flags, as the batcher runs with them
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 60_000_000


def test_a_model_without_a_batch_dim_on_every_tensor_has_max_batch_size_0(tmp_path) -> None:
    # strings: text [n] → upper [n], count [1]; count has no batch dim, so Triton's
    # convention (every tensor leads with it when max_batch_size > 0) cannot hold.
    session = Session(strings_model(tmp_path / "strings.onnx"))
    with TestClient(create_app(session, "strings")) as client:
        config = client.get("/v2/models/strings/config").json()
    parsed = _as_model_config(config)
    assert parsed.max_batch_size == 0 and not parsed.HasField("dynamic_batching")
    assert _tensors(parsed.input) == [{"name": "text", "data_type": "TYPE_STRING", "dims": [-1]}]
    assert [list(t.dims) for t in parsed.output] == [[-1], [1]]


def test_a_batch_of_scalars_is_dims_1_reshaped_as_triton_writes_it() -> None:
    spec = {"name": "score", "datatype": "FP16", "shape": [-1]}
    config = model_config(
        "m", [spec], [spec], platform="openvino", backend="openvino", kind="KIND_CPU",
        max_batch_size=4, max_delay_s=0.0025,
    )  # fmt: skip
    parsed = _as_model_config(config)
    assert list(parsed.input[0].dims) == [1] and list(parsed.input[0].reshape.shape) == []
    assert parsed.input[0].HasField("reshape")
    assert parsed.dynamic_batching.max_queue_delay_microseconds == 2500
