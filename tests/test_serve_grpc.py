"""`kiln serve` over gRPC: the KServe v2 GRPCInferenceService beside HTTP, on the same models,
batchers, limits and statistics. Real server processes on loopback, driven by the real
tritonclient.grpc, unchanged (its protos, not Kiln's)."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import onnx
import pytest
import tritonclient.grpc as tgrpc
from google.protobuf import json_format
from test_serve import BERT, RESNET, Server, _bert_feeds, _start, _stop, _until
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

import kiln
from kiln import zoo

BERT_OUTPUTS = ["last_hidden_state", "pooler_output"]


@pytest.fixture(scope="module")
def repository(module_home: Path) -> Path:
    """resnet-tiny and bert-tiny, each a plain model.onnx at version 1."""
    root = module_home / "repo"
    for model in (RESNET, BERT):
        (root / model / "1").mkdir(parents=True)
        onnx.save(zoo.build(model), root / model / "1" / "model.onnx")
    return root


@pytest.fixture(scope="module")
def served(module_home: Path, repository: Path) -> Iterator[Server]:
    """`kiln serve --model-repository REPO --max-request-mb 1`: two models, HTTP and gRPC."""
    server = _start(module_home, f"--model-repository={repository}", "--max-request-mb", "1")
    yield server
    _stop(server)


@pytest.fixture(scope="module")
def sessions(repository: Path) -> dict[str, kiln.Session]:
    return {m: kiln.Session(str(repository / m / "1" / "model.onnx")) for m in (RESNET, BERT)}


def _address(server: Server) -> str:
    return f"127.0.0.1:{server.ready['grpc_port']}"


def _client(server: Server) -> tgrpc.InferenceServerClient:
    return tgrpc.InferenceServerClient(_address(server))


def _images(batch: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random((batch, 3, 32, 32), dtype=np.float32)


def _inputs(feeds: dict[str, np.ndarray]) -> list[tgrpc.InferInput]:
    inputs = []
    for name, array in feeds.items():
        tensor = tgrpc.InferInput(name, list(array.shape), "FP32" if name == "input" else "INT64")
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def _feeds(model: str, batch: int, seed: int) -> dict[str, np.ndarray]:
    if model == RESNET:
        return {"input": _images(batch, seed)}
    return _bert_feeds(batch, 5 + seed % 20, seed)


def _outputs(model: str) -> list[str]:
    return ["logits"] if model == RESNET else BERT_OUTPUTS


def _refused(call: Any) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        call()
    return caught.value


def _grpc_stats(client: tgrpc.InferenceServerClient, model: str) -> dict[str, int]:
    (stats,) = client.get_inference_statistics(model, as_json=True)["model_stats"]
    # Protobuf's JSON writes uint64 as strings; absent means 0.
    return {
        "success": int(stats["inference_stats"]["success"].get("count", 0)),
        "inference_count": int(stats.get("inference_count", 0)),
        "execution_count": int(stats.get("execution_count", 0)),
    }


# ---------------------------------------------------------------- health, metadata, config


def test_health_metadata_and_config_answer_as_over_http(served: Server) -> None:
    client = _client(served)
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(RESNET) and client.is_model_ready(BERT, "1")
    # Triton answers ready=false, not an error, for what it does not serve.
    assert not client.is_model_ready("nope") and not client.is_model_ready(RESNET, "2")
    http = httpx.Client(base_url=served.base)
    assert client.get_server_metadata(as_json=True) == http.get("/v2").json()
    assert "model_repository" in client.get_server_metadata().extensions
    for model in (RESNET, BERT):
        meta = client.get_model_metadata(model, as_json=True)
        want = http.get(f"/v2/models/{model}").json()
        assert (meta["name"], meta["versions"], meta["platform"]) == (
            model, want["versions"], want["platform"]
        )  # fmt: skip
        for got, expected in zip(meta["inputs"] + meta["outputs"],
                                 want["inputs"] + want["outputs"], strict=True):  # fmt: skip
            assert got["name"] == expected["name"] and got["datatype"] == expected["datatype"]
            assert [int(d) for d in got["shape"]] == expected["shape"]
        # One ModelConfig for both protocols: /config's JSON, read with Triton's own schema,
        # is the message gRPC sends.
        config = client.get_model_config(model).config
        assert config == json_format.ParseDict(
            http.get(f"/v2/models/{model}/config").json(), model_config_pb2.ModelConfig()
        )
        assert config.name == model and config.max_batch_size == 16
        assert config.dynamic_batching.max_queue_delay_microseconds == 0


# ---------------------------------------------------------------- inference


def test_200_concurrent_requests_on_two_models_equal_kiln_sessions(served, sessions) -> None:
    client = _client(served)
    before = {m: _grpc_stats(client, m) for m in (RESNET, BERT)}
    requests_before = {m: served.metric(f'kiln_requests_total{{model="{m}"}}') for m in before}
    jobs = [(RESNET if i % 2 else BERT, i % 3 + 1, i) for i in range(200)]
    answers: dict[int, Any] = {}
    done = threading.Condition()

    def answered(index: int, result: Any, error: Any) -> None:
        with done:
            answers[index] = error if error is not None else result
            done.notify_all()

    # All 200 in flight at once on one channel, built first so they are sent back to back.
    built = [_inputs(_feeds(model, batch, seed)) for model, batch, seed in jobs]
    for index, ((model, _, _), inputs) in enumerate(zip(jobs, built, strict=True)):
        client.async_infer(
            model, inputs, lambda result, error, i=index: answered(i, result, error),
            outputs=[tgrpc.InferRequestedOutput(n) for n in _outputs(model)],
            request_id=str(index),
        )  # fmt: skip
    with done:
        assert done.wait_for(lambda: len(answers) == len(jobs), timeout=120), len(answers)
    failures = [a for a in answers.values() if isinstance(a, InferenceServerException)]
    assert failures == []
    for index, (model, batch, seed) in enumerate(jobs):
        result = answers[index]
        assert result.get_response().id == str(index)
        want = sessions[model].run(None, _feeds(model, batch, seed))
        for name, expected in zip(_outputs(model), want, strict=True):
            np.testing.assert_allclose(result.as_numpy(name), expected, rtol=1e-4, atol=1e-5)
    # Counted as HTTP requests are: Triton's statistics (over gRPC and HTTP alike) and /metrics.
    http_stats = httpx.get(f"{served.base}/v2/models/stats").json()["model_stats"]
    runs = 0
    for model in (RESNET, BERT):
        sent = [job for job in jobs if job[0] == model]
        after = _grpc_stats(client, model)
        assert after["success"] - before[model]["success"] == len(sent)
        samples = sum(batch for _, batch, _ in sent)
        assert after["inference_count"] - before[model]["inference_count"] == samples
        (http,) = [s for s in http_stats if s["name"] == model]
        assert http["inference_count"] == after["inference_count"]
        requests = served.metric(f'kiln_requests_total{{model="{model}"}}')
        assert requests - requests_before[model] == len(sent)
        runs += after["execution_count"] - before[model]["execution_count"]
    # Each request ran in exactly one execution; whether two shared one depends on how fast
    # the host answers (a fast one runs each before the next arrives), so that is asserted
    # where it is deterministic, in test_serve.py's batcher test.
    assert 0 < runs <= len(jobs)


def _raw_request(model: str, feeds: dict[str, np.ndarray]) -> service_pb2.ModelInferRequest:
    """A ModelInferRequest with each input in its typed `contents` field, as tritonclient
    never sends them (it sends raw_input_contents)."""
    request = service_pb2.ModelInferRequest(model_name=model)
    for name, array in feeds.items():
        tensor = request.inputs.add(name=name, shape=array.shape)
        if array.dtype == np.float32:
            tensor.datatype = "FP32"
            tensor.contents.fp32_contents.extend(array.ravel().tolist())
        else:
            tensor.datatype = "INT64"
            tensor.contents.int64_contents.extend(array.ravel().tolist())
    return request


def test_typed_contents_are_taken_and_checked(served, sessions) -> None:
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(_address(served)))
    for model in (RESNET, BERT):
        feeds = _feeds(model, 2, 7)
        answer = stub.ModelInfer(_raw_request(model, feeds))
        assert [o.name for o in answer.outputs] == _outputs(model)
        result = tgrpc.InferResult(answer)
        for name, want in zip(_outputs(model), sessions[model].run(None, feeds), strict=True):
            np.testing.assert_allclose(result.as_numpy(name), want, rtol=1e-4, atol=1e-5)
    images = _feeds(RESNET, 1, 0)
    short = _raw_request(RESNET, images)
    del short.inputs[0].contents.fp32_contents[-1]
    wrong_field = _raw_request(RESNET, {"input": images["input"].astype(np.int64)})
    wrong_field.inputs[0].datatype = "FP32"
    both = _raw_request(RESNET, images)
    both.raw_input_contents.append(images["input"].tobytes())
    unknown = _raw_request(RESNET, {"z": np.zeros(0, np.float32)})  # its name before its data
    unknown.inputs[0].shape[:] = [64]
    for request, message in [
        (unknown, f"unknown input 'z'; the model's inputs are {['input']}"),
        (short, "input 'input': shape [1, 3, 32, 32] needs 3072 values, the data has 3071"),
        (wrong_field, "input 'input': FP32 data goes in contents.fp32_contents, not int64"),
        (both, "input 'input' has both contents and raw_input_contents"),
    ]:
        with pytest.raises(grpc.RpcError) as caught:
            stub.ModelInfer(request)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in caught.value.details()


def test_bad_requests_carry_tritons_codes_and_name_what_is_wrong(served) -> None:
    client = _client(served)
    images = _images(1, 0)
    refused = _refused(lambda: client.infer("nope", _inputs({"input": images})))
    assert refused.status() == "StatusCode.NOT_FOUND"
    assert refused.message() == f"unknown model 'nope'; this server serves '{BERT}', '{RESNET}'"
    for call in (client.get_model_metadata, client.get_model_config):
        assert _refused(lambda c=call: c("nope")).status() == "StatusCode.NOT_FOUND"
    wrong_shape = _refused(lambda: client.infer(RESNET, _inputs({"input": images[:, :, :31]})))
    assert wrong_shape.status() == "StatusCode.INVALID_ARGUMENT"
    assert "input 'input' has shape [1, 3, 31, 32], expected FP32" in wrong_shape.message()
    feeds = _bert_feeds(1, 8)
    del feeds["attention_mask"]
    missing = _refused(lambda: client.infer(BERT, _inputs(feeds)))
    assert missing.status() == "StatusCode.INVALID_ARGUMENT"
    assert "missing input 'attention_mask'" in missing.message()
    unknown_output = _refused(
        lambda: client.infer(
            RESNET, _inputs({"input": images}), outputs=[tgrpc.InferRequestedOutput("x")]
        )
    )
    assert "unknown output 'x'" in unknown_output.message()
    # Over the max_batch_size /config advertises: INVALID_ARGUMENT before any work, as Triton.
    most = client.get_model_config(RESNET).config.max_batch_size
    over = _refused(lambda: client.infer(RESNET, _inputs({"input": _images(most + 1, 0)})))
    assert over.status() == "StatusCode.INVALID_ARGUMENT"
    assert f"has batch size {most + 1} (dim 0)" in over.message()
    # Over --max-request-mb (1 MiB): RESOURCE_EXHAUSTED, as Triton's own limit, in Kiln's words.
    too_big = _refused(lambda: client.infer(RESNET, _inputs({"input": _images(100, 0)})))
    assert too_big.status() == "StatusCode.RESOURCE_EXHAUSTED"
    assert "exceeds the server's limit of 1 MiB (kiln serve --max-request-mb)" in too_big.message()
    assert client.is_server_ready()  # and the server still answers
    # Streaming, shared memory, trace and log settings are not served: said in Kiln's words.
    for call, words in [
        (client.get_system_shared_memory_status, "shared-memory extension is not supported"),
        (client.get_cuda_shared_memory_status, "shared-memory extension is not supported"),
        (client.get_trace_settings, "trace settings are not served"),
        (client.get_log_settings, "log settings are not served"),
    ]:
        refused = _refused(call)
        assert refused.status() == "StatusCode.UNIMPLEMENTED" and words in refused.message()
    stub = service_pb2_grpc.GRPCInferenceServiceStub(grpc.insecure_channel(_address(served)))
    with pytest.raises(grpc.RpcError) as streamed:
        list(stub.ModelStreamInfer(iter([service_pb2.ModelInferRequest(model_name=RESNET)])))
    assert streamed.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "send each request with ModelInfer" in streamed.value.details()


def _failures(server: Server, model: str) -> tuple[float, float]:
    """Triton's and Kiln's failure counters of `model` in /metrics (413s for Kiln's)."""
    text = httpx.get(f"{server.base}/metrics").text
    triton = re.search(rf'^nv_inference_request_failure{{model="{model}".*}} (\S+)$', text, re.M)
    kiln_ = re.search(
        rf'^kiln_request_failures_total{{code="413",model="{model}"}} (\S+)$', text, re.M
    )
    return (float(triton[1]) if triton else 0.0), (float(kiln_[1]) if kiln_ else 0.0)


def test_a_message_over_the_limit_is_counted_for_its_model(served) -> None:
    before = _failures(served, RESNET)
    too_big = _refused(lambda: _client(served).infer(RESNET, _inputs({"input": _images(100, 0)})))
    assert too_big.status() == "StatusCode.RESOURCE_EXHAUSTED"
    assert _failures(served, RESNET) == (before[0] + 1, before[1] + 1)


# ---------------------------------------------------------------- the repository


def test_repository_index_unload_and_load_over_grpc(served) -> None:
    client = _client(served)
    index = client.get_model_repository_index(as_json=True)["models"]
    assert [(m["name"], m["version"], m["state"]) for m in index] == [
        (BERT, "1", "READY"),
        (RESNET, "1", "READY"),
    ]
    client.unload_model(RESNET)
    assert not client.is_model_ready(RESNET) and client.is_model_ready(BERT)
    gone = _refused(lambda: client.infer(RESNET, _inputs({"input": _images(1, 0)})))
    assert gone.status() == "StatusCode.NOT_FOUND" and "not loaded (unloaded)" in gone.message()
    ready = client.get_model_repository_index(as_json=True)["models"]
    assert {m["name"]: (m["state"], m.get("reason")) for m in ready}[RESNET] == (
        "UNAVAILABLE", "unloaded"
    )  # fmt: skip
    client.load_model(RESNET)
    assert client.is_model_ready(RESNET)
    assert client.infer(RESNET, _inputs({"input": _images(1, 0)})).as_numpy("logits").shape == (
        1, 10
    )  # fmt: skip
    unknown = _refused(lambda: client.load_model("nope"))
    assert unknown.status() == "StatusCode.NOT_FOUND"
    assert "unknown model 'nope'" in unknown.message()
    override = _refused(lambda: client.load_model(RESNET, config='{"max_batch_size": 4}'))
    assert override.status() == "StatusCode.INVALID_ARGUMENT"
    assert "load parameter 'config' is not taken" in override.message()


# ---------------------------------------------------------------- limits, shutdown, flags


def test_a_full_queue_is_unavailable_and_shutdown_answers_queued_grpc_requests(tmp_path) -> None:
    # A long batching delay keeps requests queued: a burst overflows the queue of 2, and the
    # signal comes while the first two still wait.
    server = _start(
        tmp_path, f"zoo:{RESNET}", "--max-queue", "2", "--max-batch", "64", "--max-delay-ms", "3000"
    )
    client = _client(server)
    answers: list[Any] = []
    done = threading.Condition()

    def answered(result: Any, error: Any) -> None:
        with done:
            answers.append(error if error is not None else result)
            done.notify_all()

    for seed in range(8):
        client.async_infer(RESNET, _inputs({"input": _images(1, seed)}), answered)
    with done:  # the refusals come at once; the two queued wait for their batch
        assert done.wait_for(lambda: len(answers) >= 6, timeout=30), answers
    _until(lambda: server.metric("kiln_queue_depth") >= 2, "2 queued requests", timeout=3)
    server.proc.send_signal(signal.SIGTERM)
    with done:
        assert done.wait_for(lambda: len(answers) == 8, timeout=30), answers
    refused = [a for a in answers if isinstance(a, InferenceServerException)]
    assert len(refused) == 6 and {r.status() for r in refused} == {"StatusCode.UNAVAILABLE"}
    assert "server overloaded" in refused[0].message() and "--max-queue" in refused[0].message()
    assert len([a for a in answers if not isinstance(a, InferenceServerException)]) == 2
    assert server.proc.wait(30) == 0


def test_grpc_port_minus_one_serves_http_only(tmp_path) -> None:
    server = _start(tmp_path, f"zoo:{RESNET}", "--grpc-port", "-1")
    try:
        assert server.ready["grpc_port"] is None
        assert httpx.get(f"{server.ready['url']}/ready").status_code == 200
    finally:
        _stop(server)


def test_a_grpc_port_that_cannot_be_bound_is_one_line_and_exit_2() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for args, message in [
            (["--port", "0", "--grpc-port", port], f"--grpc-port {port}: the port is in use"),
            (["--port", "0", "--grpc-port", "70000"], "--grpc-port 70000: use a port from 1"),
            (["--port", "8123", "--grpc-port", "8123"], "--grpc-port 8123 is --port too"),
        ]:
            done = subprocess.run(
                [sys.executable, "-m", "kiln", "serve", f"zoo:{RESNET}", *args],
                capture_output=True, text=True, timeout=120,
            )  # fmt: skip
            assert done.returncode == 2 and message in done.stderr, (args, done.stderr)
            assert len(done.stderr.strip().splitlines()) == 1, done.stderr
