"""`kiln export --runtime kiln` on a real Triton server: the `tritonserver` binary and Python
backend of the nvidia-pytriton wheel, on loopback (`kiln.deploy.local_triton`), driven by
tritonclient over HTTP and gRPC.

The model runs in a separate virtual environment (numpy 1.26 for the Python backend's stub;
see local_triton), built once and cached in pytest's cache directory, keyed by its versions
(KILN_TRITON_ENV names a directory to use instead).

Skipped where the environment cannot be built or the server cannot start, with the reason;
under CI=true that fails instead.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, closing
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as triton_http
from string_models import strings_model
from tritonclient.utils import InferenceServerException

import kiln
from kiln.deploy import export_triton
from kiln.deploy.local_triton import (
    Triton,
    TritonEnv,
    TritonUnavailable,
    ensure_env,
    env_dir,
    running,
)
from kiln.ir.inputs import synthesize

CI = os.environ.get("CI") == "true"
BERT, RESNET, STRINGS = "bert-tiny", "resnet-tiny", "strings"
PARTS = "two-tower-tiny"  # a partitioned artifact: its parts, all on ONNX Runtime here
BERT_ORT, RESNET_OPENVINO = "bert-tiny-ort", "resnet-tiny-openvino"  # native forms
BATCH_DELAY_MS = 50  # bert's tuned batcher: a window wide enough for concurrent requests


def unavailable(why: str) -> None:
    if CI:
        pytest.fail(f"{why}; CI=true: the real-Triton test must run in CI")
    pytest.skip(why)


@pytest.fixture(scope="module")
def env(request: pytest.FixtureRequest) -> TritonEnv:
    cache = getattr(request.config, "cache", None)  # None under -p no:cacheprovider
    base = cache.mkdir("kiln-triton") if cache else Path(tempfile.gettempdir()) / "kiln-triton"
    try:
        return ensure_env(env_dir(Path(base)))
    except TritonUnavailable as exc:
        unavailable(str(exc))


# ---------------------------------------------------------------- the server


@dataclass
class Server(Triton):
    """The running server (http, grpc: host:port, as tritonclient wants it), and what it
    serves."""

    exports: dict[str, object]  # model → its TritonExport
    artifacts: dict[str, Path]
    sessions: dict[str, kiln.Session] = field(default_factory=dict)

    def session(self, model: str) -> kiln.Session:
        """kiln.Session on the artifact Triton serves a copy of: the reference answers."""
        if model not in self.sessions:
            self.sessions[model] = kiln.Session(self.artifacts[model])
        return self.sessions[model]


def _export(where: Path) -> tuple[dict[str, Path], dict[str, object]]:
    """bert-tiny (its tuned batcher set to a delay, as `kiln tune --clients` records it),
    resnet-tiny and a model of strings without a batch dim, compiled and exported for Kiln's
    runtime into one repository."""
    artifacts = {m: kiln.compile(f"zoo:{m}", where / f"{m}.kiln").path for m in (BERT, RESNET)}
    strings = strings_model(where / "strings.onnx")
    artifacts[STRINGS] = kiln.compile(strings, where / f"{STRINGS}.kiln").path
    artifacts[PARTS] = kiln.compile(f"zoo:{PARTS}", where / f"{PARTS}.kiln",
                                    partition="text=ort").path  # fmt: skip
    manifest = artifacts[BERT] / "manifest.json"
    data = json.loads(manifest.read_text())
    data["benchmark"] = {"tune": {"serving": {"max_batch": 8, "max_delay_ms": BATCH_DELAY_MS}}}
    manifest.write_text(json.dumps(data))
    exports = {m: export_triton(a, where / "repo", runtime="kiln") for m, a in artifacts.items()}
    # The native forms, beside them: Triton's ONNX Runtime backend, and OpenVINO's.
    openvino = kiln.compile(f"zoo:{RESNET}", where / "resnet-ov.kiln", backend="openvino").path
    for model, artifact in [(BERT_ORT, artifacts[BERT]), (RESNET_OPENVINO, openvino)]:
        exports[model] = export_triton(artifact, where / "repo", name=model)
    return artifacts, exports


@pytest.fixture(scope="module")
def server(env: TritonEnv, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    where = tmp_path_factory.mktemp("triton")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KILN_HOME", str(where / "home"))  # the server's KILN_HOME too
        artifacts, exports = _export(where)
    # Kiln's runtime loaded at start; the native forms are loaded by a test (see there).
    models = [BERT, RESNET, STRINGS, PARTS]
    with ExitStack() as stack:
        try:
            triton = stack.enter_context(running(where / "repo", models, where, env=env,
                                                 timeout=120))  # fmt: skip
        except TritonUnavailable as exc:
            unavailable(str(exc))
        yield Server(triton.proc, triton.http, triton.grpc, triton.log, exports, artifacts)


# ---------------------------------------------------------------- requests


def _bert_feeds(batch: int, seq: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, seq), np.int64)
    mask[0, seq - seq // 3 :] = 0  # a padded first row, as real traffic has
    return {
        "input_ids": rng.integers(0, 1000, (batch, seq)).astype(np.int64),
        "attention_mask": mask,
        "token_type_ids": np.zeros((batch, seq), np.int64),
    }


def _resnet_feeds(batch: int, seed: int) -> dict[str, np.ndarray]:
    return {"input": np.random.default_rng(seed).random((batch, 3, 32, 32), np.float32)}


def _inputs(module, feeds: dict[str, np.ndarray]) -> list:
    """tritonclient inputs (module: tritonclient.http or tritonclient.grpc)."""
    tensors = []
    for name, array in feeds.items():
        tensor = module.InferInput(name, list(array.shape), _datatype(array))
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def _datatype(array: np.ndarray) -> str:
    from tritonclient.utils import np_to_triton_dtype

    return np_to_triton_dtype(array.dtype)


def _grpc():
    try:
        import tritonclient.grpc as triton_grpc
    except (ImportError, RuntimeError) as exc:  # RuntimeError: tritonclient without grpcio
        unavailable(f"tritonclient.grpc cannot be imported ({exc}); pip install grpcio")
    return triton_grpc


CASES = [
    (BERT, _bert_feeds(1, 16, 0)),
    (BERT, _bert_feeds(2, 24, 1)),
    (RESNET, _resnet_feeds(1, 2)),
    (RESNET, _resnet_feeds(3, 3)),
]


def _assert_same(got: dict[str, np.ndarray], want: list[np.ndarray], names: list[str]) -> None:
    for name, expected in zip(names, want, strict=True):
        np.testing.assert_allclose(got[name], expected, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_triton_answers_equal_kiln_session(server: Server, protocol: str) -> None:
    module = triton_http if protocol == "http" else _grpc()
    url = server.http if protocol == "http" else server.grpc
    with closing(module.InferenceServerClient(url)) as client:  # open connections delay exit
        _answers_equal(client, module, server)


def _answers_equal(client, module, server: Server) -> None:
    for model, feeds in CASES:
        session = server.session(model)
        result = client.infer(model, _inputs(module, feeds))
        names = session.output_names
        _assert_same({n: result.as_numpy(n) for n in names}, session.run(None, feeds), names)


def test_triton_serves_the_config_kiln_wrote(server: Server) -> None:
    with closing(triton_http.InferenceServerClient(server.http)) as client:
        _configs_as_written(client, server)


def _configs_as_written(client: triton_http.InferenceServerClient, server: Server) -> None:
    for model in (BERT, RESNET):
        served = client.get_model_config(model)
        written = server.exports[model].config
        assert served["backend"] == "python"
        assert served["max_batch_size"] == written["max_batch_size"] > 0
        for key in ("input", "output"):
            assert [(t["name"], t["data_type"], [int(d) for d in t["dims"]]) for t in served[key]]\
                == [(t["name"], t["data_type"], t["dims"]) for t in written[key]]  # fmt: skip
        delay = int(served["dynamic_batching"].get("max_queue_delay_microseconds", 0))
        assert delay == written["dynamic_batching"].get("max_queue_delay_microseconds", 0)
        assert served["instance_group"][0]["kind"] == "KIND_CPU"
    assert server.exports[BERT].config["max_batch_size"] == 8  # the tuned batcher's
    assert int(client.get_model_config(BERT)["dynamic_batching"]["max_queue_delay_microseconds"])\
        == BATCH_DELAY_MS * 1000  # fmt: skip


def test_concurrent_requests_are_batched_by_triton_and_answered_right(server: Server) -> None:
    with closing(triton_http.InferenceServerClient(server.http, concurrency=8)) as client:
        _batched(client, server)


def _batched(client: triton_http.InferenceServerClient, server: Server) -> None:
    stats = client.get_inference_statistics(BERT)["model_stats"][0]
    before = int(stats["inference_count"]), int(stats["execution_count"])
    requests = [_bert_feeds(1, 16, 100 + i) for i in range(12)]
    pending = [client.async_infer(BERT, _inputs(triton_http, f)) for f in requests]
    results = [p.get_result() for p in pending]
    session = server.session(BERT)
    for feeds, result in zip(requests, results, strict=True):
        names = session.output_names
        _assert_same({n: result.as_numpy(n) for n in names}, session.run(None, feeds), names)
    stats = client.get_inference_statistics(BERT)["model_stats"][0]
    inferences = int(stats["inference_count"]) - before[0]
    executions = int(stats["execution_count"]) - before[1]
    assert inferences == len(requests)
    assert executions < inferences  # requests shared executions within the tuned delay


def _client_mistakes(server: Server) -> list[tuple[dict[str, np.ndarray], str]]:
    """Requests kiln.Session refuses, with the message it refuses each with: one past the
    model's sequence table, and a token id past its vocabulary (found by the engine)."""
    session = server.session(BERT)
    too_long = _bert_feeds(1, session.limits["seq"].limit + 1, 5)
    bad_id = _bert_feeds(1, 8, 6)
    bad_id["input_ids"][0, 0] = 10**6
    mistakes = []
    for feeds in (too_long, bad_id):
        with pytest.raises(kiln.KilnError) as refused:
            session.run(None, feeds)
        mistakes.append((feeds, str(refused.value)))
    return mistakes


WANT_STATUS = {"http": "400", "grpc": "StatusCode.INVALID_ARGUMENT"}


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_client_mistake_is_invalid_argument_with_kilns_reason(server: Server,
                                                                protocol: str) -> None:  # fmt: skip
    module = triton_http if protocol == "http" else _grpc()
    url = server.http if protocol == "http" else server.grpc
    with closing(module.InferenceServerClient(url)) as client:
        for feeds, reason in _client_mistakes(server):
            with pytest.raises(InferenceServerException) as answer:
                client.infer(BERT, _inputs(module, feeds))
            assert answer.value.status() == WANT_STATUS[protocol]
            assert reason.split(": ", 1)[-1] in answer.value.message()
        model, feeds = CASES[0]  # and the model still answers
        result = client.infer(model, _inputs(module, feeds))
    session = server.session(model)
    names = session.output_names
    _assert_same({n: result.as_numpy(n) for n in names}, session.run(None, feeds), names)


def test_a_partitioned_artifact_is_served_whole(server: Server) -> None:
    session = server.session(PARTS)
    assert len(session.parts) > 1
    feeds = synthesize(session.interface, dims={**session.artifact.manifest.dims, "batch": 2})
    with closing(triton_http.InferenceServerClient(server.http)) as client:
        result = client.infer(PARTS, _inputs(triton_http, feeds))
    names = session.output_names
    _assert_same({n: result.as_numpy(n) for n in names}, session.run(None, feeds), names)


def test_text_tensors_and_a_model_without_a_batch_dim(server: Server) -> None:
    text = np.array(["kiln", "héllo wörld", ""], dtype=object)
    session = server.session(STRINGS)
    want = dict(zip(session.output_names, session.run(None, {"text": text}), strict=True))
    with closing(triton_http.InferenceServerClient(server.http)) as client:
        assert int(client.get_model_config(STRINGS).get("max_batch_size", 0)) == 0
        tensor = triton_http.InferInput("text", [len(text)], "BYTES")
        tensor.set_data_from_numpy(np.array([t.encode() for t in text], dtype=object))
        result = client.infer(STRINGS, [tensor])
    assert [b.decode() for b in result.as_numpy("upper")] == list(want["upper"])
    np.testing.assert_array_equal(result.as_numpy("count"), want["count"])


@pytest.mark.parametrize(("model", "backend"), [(BERT_ORT, "onnxruntime"),
                                                (RESNET_OPENVINO, "openvino")])  # fmt: skip
def test_native_configs_pass_tritons_own_parse_and_checks(server: Server, model, backend) -> None:
    """The pytriton wheel's server has only the Python backend. Triton parses config.pbtxt,
    normalizes it and checks it (inputs, outputs, batching, instance groups) before it looks
    for the backend: a load that stops at the missing backend got past all of that. (A
    config it cannot parse answers "failed to poll from model repository" instead.)"""
    answer = httpx.post(f"http://{server.http}/v2/repository/models/{model}/load", timeout=60)
    assert answer.status_code == 400
    assert f"unable to find backend library for backend '{backend}'" in answer.json()["error"]
