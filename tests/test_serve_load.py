"""`kiln serve` under load: two models in one server, hundreds of requests in flight at once
over HTTP and gRPC, and models unloaded and loaded while another is busy. Real server process
on loopback, driven by the real tritonclient.http and tritonclient.grpc; every answer compared
with an in-process `kiln.Session` of the same model on the same input."""

from __future__ import annotations

import functools
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gevent
import httpx
import numpy as np
import onnx
import pytest
import tritonclient.grpc as tgrpc
import tritonclient.http as thttp
from google.protobuf import json_format
from test_serve import BERT, RESNET, Server, _bert_feeds, _start, _stop, _until
from test_serve_models import Traffic
from tritonclient.grpc import service_pb2
from tritonclient.utils import InferenceServerException

import kiln
from kiln import zoo

MODELS = (RESNET, BERT)
OUTPUTS = {RESNET: ["logits"], BERT: ["last_hidden_state", "pooler_output"]}
PER_PROTOCOL = 400  # requests in flight together over each protocol, half to each model
# Every request to one model may be waiting in its batcher at once (half of each protocol's):
# the queue bound that refuses none of them, and the one the server is given.
PER_MODEL = PER_PROTOCOL // len(MODELS) * 2
TOLERANCE = {"rtol": 1e-4, "atol": 1e-5}
FLOOD_DEPTH = 16  # requests kept in flight over each protocol to the model kept busy
# A gRPC answer's code → the HTTP status kiln serve gives the same failure.
HTTP_STATUS = {"StatusCode.NOT_FOUND": 404, "StatusCode.UNAVAILABLE": 503}


@pytest.fixture(scope="module")
def repository(module_home: Path) -> Path:
    """Both tiny models, each a plain model.onnx at version 1: loadable and unloadable."""
    root = module_home / "repo"
    for model in MODELS:
        (root / model / "1").mkdir(parents=True)
        onnx.save(zoo.build(model), root / model / "1" / "model.onnx")
    return root


@pytest.fixture(scope="module")
def served(module_home: Path, repository: Path) -> Iterator[Server]:
    server = _start(module_home, f"--model-repository={repository}", "--max-queue", str(PER_MODEL))
    yield server
    _stop(server)


@pytest.fixture(scope="module")
def sessions(repository: Path) -> dict[str, kiln.Session]:
    return {m: kiln.Session(str(repository / m / "1" / "model.onnx")) for m in MODELS}


def _address(server: Server) -> str:
    return f"127.0.0.1:{server.ready['grpc_port']}"


def _feeds(model: str, batch: int, seed: int) -> dict[str, np.ndarray]:
    if model == RESNET:
        return {"input": np.random.default_rng(seed).random((batch, 3, 32, 32), np.float32)}
    return _bert_feeds(batch, 5 + seed % 20, seed)


def _datatype(array: np.ndarray) -> str:
    return "FP32" if array.dtype == np.float32 else "INT64"


def _http_infer(
    client: thttp.InferenceServerClient, model: str, feeds: dict[str, np.ndarray], rid: str = ""
) -> list[np.ndarray]:
    inputs = []
    for name, array in feeds.items():
        tensor = thttp.InferInput(name, list(array.shape), _datatype(array))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    outputs = [thttp.InferRequestedOutput(name) for name in OUTPUTS[model]]
    result = client.infer(model, inputs, outputs=outputs, request_id=rid)
    assert result.get_response().get("id", "") == rid
    return [result.as_numpy(name) for name in OUTPUTS[model]]


def _grpc_args(model: str, feeds: dict[str, np.ndarray]) -> dict[str, Any]:
    inputs = []
    for name, array in feeds.items():
        tensor = tgrpc.InferInput(name, list(array.shape), _datatype(array))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    outputs = [tgrpc.InferRequestedOutput(name) for name in OUTPUTS[model]]
    return {"model_name": model, "inputs": inputs, "outputs": outputs}


def _grpc_values(model: str, result: tgrpc.InferResult) -> list[np.ndarray]:
    return [result.as_numpy(name) for name in OUTPUTS[model]]


def _statistics(server: Server, model: str) -> Any:
    """Triton's ModelStatistics of `model` over gRPC, checked to be what HTTP's /stats says,
    read with Triton's own schema (which refuses a field it does not name)."""
    over_grpc = tgrpc.InferenceServerClient(_address(server)).get_inference_statistics(model)
    over_http = httpx.get(f"{server.base}/v2/models/{model}/stats").json()
    assert json_format.ParseDict(over_http, service_pb2.ModelStatisticsResponse()) == over_grpc
    (stats,) = over_grpc.model_stats
    return stats


# ---------------------------------------------------------------- two models, 800 requests


def test_400_http_and_400_grpc_requests_at_once_equal_sessions_and_are_counted(
    served: Server, sessions: dict[str, kiln.Session]
) -> None:
    # Distinct inputs per request: model, batch size 1-3 and seed from its number.
    jobs = {
        protocol: [(MODELS[i % 2], i % 3 + 1, offset + i) for i in range(PER_PROTOCOL)]
        for protocol, offset in (("http", 0), ("grpc", PER_PROTOCOL))
    }
    before = {m: _statistics(served, m) for m in MODELS}

    answers: dict[int, Any] = {}
    answered = threading.Condition()

    def grpc_done(index: int, result: Any, error: Any) -> None:
        with answered:
            answers[index] = error if error is not None else result
            answered.notify_all()

    # Built first (serialising 400 requests takes a while), then all sent together below.
    grpc_requests = [_grpc_args(m, _feeds(m, b, s)) for m, b, s in jobs["grpc"]]
    http = thttp.InferenceServerClient(served.url, concurrency=PER_PROTOCOL)
    # One greenlet per request on one client: what async_infer does, without the 10 ms pause
    # it takes after each send, so that all 400 are sent before the first answer is read.
    greenlets = [
        gevent.spawn(_http_infer, http, m, _feeds(m, b, s), str(s)) for m, b, s in jobs["http"]
    ]
    grpc = tgrpc.InferenceServerClient(_address(served))
    for index, request in enumerate(grpc_requests):
        grpc.async_infer(
            **request, callback=functools.partial(grpc_done, index), request_id=str(index)
        )
    gevent.joinall(greenlets, timeout=120)  # runs the greenlets: the HTTP requests go out
    with answered:
        assert answered.wait_for(lambda: len(answers) == PER_PROTOCOL, timeout=120), len(answers)
    http.close()

    assert [g.exception for g in greenlets if not g.successful()] == []
    assert [a for a in answers.values() if isinstance(a, InferenceServerException)] == []
    assert [answers[i].get_response().id for i in range(PER_PROTOCOL)] == [
        str(i) for i in range(PER_PROTOCOL)
    ]
    got = [g.value for g in greenlets] + [
        _grpc_values(jobs["grpc"][i][0], answers[i]) for i in range(PER_PROTOCOL)
    ]
    for (model, batch, seed), values in zip(jobs["http"] + jobs["grpc"], got, strict=True):
        want = sessions[model].run(None, _feeds(model, batch, seed))
        for value, expected in zip(values, want, strict=True):
            np.testing.assert_allclose(value, expected, **TOLERANCE)

    batched = []
    for model in MODELS:
        sent = [job for requests in jobs.values() for job in requests if job[0] == model]
        stats = _statistics(served, model)
        phases, earlier = stats.inference_stats, before[model].inference_stats
        assert phases.success.count - earlier.success.count == len(sent)
        assert phases.fail.count == earlier.fail.count
        samples = stats.inference_count - before[model].inference_count
        assert samples == sum(batch for _, batch, _ in sent)
        runs = stats.execution_count - before[model].execution_count
        assert 0 < runs <= samples
        batched.append(runs < len(sent))  # requests shared runs
        # Every success went through each phase once; every run is in one batch size's row.
        for phase in (phases.queue, phases.compute_input, phases.compute_infer,
                      phases.compute_output):  # fmt: skip
            assert phase.count == phases.success.count
        rows = stats.batch_stats
        assert sum(row.compute_infer.count for row in rows) == stats.execution_count
        assert sum(row.batch_size * row.compute_infer.count for row in rows) == (
            stats.inference_count
        )
    assert any(batched), "400 requests in flight per model, yet every one ran alone"


# ---------------------------------------------------------------- load and unload under load


class Flood:
    """Requests to one model kept `depth` in flight over each protocol until stopped, each
    answer checked against `cases` (feeds → the outputs expected). Every request sent is
    answered or the test fails: `wait_for(n)` waits on answers, not on time."""

    def __init__(self, server: Server, model: str, cases: list[tuple[dict, list]], depth: int):
        self.server, self.model, self.cases, self.depth = server, model, cases, depth
        self.answers = {"http": 0, "grpc": 0}
        self.sent = 0
        self.failures: list[Any] = []
        self._stop = threading.Event()
        self._answered = threading.Condition()
        self._grpc = tgrpc.InferenceServerClient(_address(server))
        # tritonclient.grpc's async_infer keeps its call in the client for a moment: one at a
        # time (reentrant: an answer already in runs its callback inside the call).
        self._one_call = threading.RLock()
        self._http = threading.Thread(target=self._http_loop, daemon=True)

    def __enter__(self) -> Flood:
        self._http.start()
        for k in range(self.depth):
            self._send_grpc(k)
        return self

    def __exit__(self, *exc: object) -> None:
        with self._answered:  # under the lock `_sending` counts under: nothing sent after
            self._stop.set()
        self._http.join(60)
        with self._answered:  # what was sent is answered: nothing lost
            done = self._answered.wait_for(lambda: sum(self.answers.values()) == self.sent, 60)
        assert done and not self._http.is_alive(), (self.sent, self.answers)

    def wait_for(self, more: int) -> None:
        """Until each protocol has `more` further answers."""
        with self._answered:
            target = {p: n + more for p, n in self.answers.items()}
            done = self._answered.wait_for(
                lambda: all(self.answers[p] >= n for p, n in target.items()), timeout=60
            )
        assert done, f"waited 60 s for {more} answers per protocol: {self.answers}"

    def _record(self, protocol: str, case: int, values: Any, error: Any) -> None:
        if error is None:
            try:
                for value, want in zip(values, self.cases[case][1], strict=True):
                    np.testing.assert_allclose(value, want, **TOLERANCE)
            except AssertionError as wrong:
                error = wrong
        with self._answered:
            self.answers[protocol] += 1
            if error is not None:
                self.failures.append((protocol, error))
            self._answered.notify_all()

    def _sending(self) -> bool:
        """Whether to send one more, counted as sent if so."""
        with self._answered:
            if self._stop.is_set():
                return False
            self.sent += 1
            return True

    def _send_grpc(self, number: int) -> None:
        case = number % len(self.cases)

        def done(result: Any, error: Any) -> None:
            values = _grpc_values(self.model, result) if error is None else None
            self._record("grpc", case, values, error)
            self._send_grpc(number + self.depth)

        with self._one_call:
            if self._sending():
                request = _grpc_args(self.model, self.cases[case][0])
                self._grpc.async_infer(**request, callback=done)

    def _http_loop(self) -> None:
        """`depth` greenlets on one client, on this thread's own gevent hub."""
        client = thttp.InferenceServerClient(self.server.url, concurrency=self.depth)

        def requests(first: int) -> None:
            number = first
            while self._sending():
                case = number % len(self.cases)
                try:
                    values, error = _http_infer(client, self.model, self.cases[case][0]), None
                except Exception as exc:  # noqa: BLE001 - any failure fails the test
                    values, error = None, exc
                self._record("http", case, values, error)
                number += self.depth

        gevent.joinall([gevent.spawn(requests, k) for k in range(self.depth)])
        client.close()


def _expected_refusal(model: str, status: int, message: str) -> int:
    """`status`, if it is what a model being unloaded and loaded answers: 404 while it is not
    loaded, 503 while it is loading again. Anything else (a request taken and then dropped,
    a 500) raises, a failure of the probe."""
    if status == 404 and f"model '{model}' is not loaded (unloaded)" in message:
        return status
    if status == 503 and f"model '{model}' is loading" in message:
        return status
    raise AssertionError(f"answered {status}: {message}")


def _http_probe(server: Server, model: str) -> Traffic:
    """Requests to `model` over plain HTTP, one at a time: its statuses, not exceptions."""
    http = httpx.Client(base_url=server.base, timeout=60)
    images = _feeds(model, 1, 0)["input"]
    body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": list(images.shape),
                        "data": images.ravel().tolist()}]}  # fmt: skip

    def call() -> int:
        response = http.post(f"/v2/models/{model}/infer", json=body)
        if response.status_code == 200:
            return 200
        return _expected_refusal(model, response.status_code, response.json()["error"])

    return Traffic(call)


def _grpc_probe(server: Server, model: str) -> Traffic:
    """Requests to `model` over gRPC, one at a time: the HTTP status of each code."""
    client = tgrpc.InferenceServerClient(_address(server))
    request = _grpc_args(model, _feeds(model, 1, 0))

    def call() -> int:
        try:
            client.infer(**request)
        except InferenceServerException as exc:
            if exc.status() not in HTTP_STATUS:
                raise
            return _expected_refusal(model, HTTP_STATUS[exc.status()], exc.message())
        return 200

    return Traffic(call)


def test_a_model_unloads_and_loads_while_the_other_serves_both_protocols_without_a_failure(
    served: Server, sessions: dict[str, kiln.Session]
) -> None:
    busy, other = BERT, RESNET
    cases = []
    for seed in range(8):
        feeds = _feeds(busy, seed % 3 + 1, seed)
        cases.append((feeds, sessions[busy].run(None, feeds)))
    grpc = tgrpc.InferenceServerClient(_address(served))
    http = thttp.InferenceServerClient(served.url)
    images = _feeds(other, 2, 99)["input"]
    unloaded = re.escape(f"model '{other}' is not loaded (unloaded)")
    with (
        Flood(served, busy, cases, FLOOD_DEPTH) as flood,
        _http_probe(served, other) as over_http,
        _grpc_probe(served, other) as over_grpc,
    ):
        flood.wait_for(10)
        # Unloaded and loaded again over HTTP's repository calls, then over gRPC's.
        for unload, load in [(http.unload_model, http.load_model),
                             (grpc.unload_model, grpc.load_model)]:  # fmt: skip
            over_http.wait_for(2)
            over_grpc.wait_for(2)
            unload(other)  # answers once the model has drained
            over_http.wait_for(2, code=404)
            over_grpc.wait_for(2, code=404)
            with pytest.raises(InferenceServerException, match=unloaded) as refused:
                grpc.infer(**_grpc_args(other, {"input": images}))
            assert refused.value.status() == "StatusCode.NOT_FOUND"
            with pytest.raises(InferenceServerException, match=unloaded):
                http.infer(other, [_http_input(images)])
            flood.wait_for(10)  # the busy model answered while the other was gone
            load(other)
            over_http.wait_for(2)
            over_grpc.wait_for(2)
            np.testing.assert_allclose(
                _http_infer(http, other, {"input": images})[0],
                sessions[other].run(None, {"input": images})[0], **TOLERANCE,
            )  # fmt: skip
            flood.wait_for(10)
        # The busy model itself reloaded with its requests in flight: each one answered.
        http.load_model(busy)
        flood.wait_for(10)
    assert flood.failures == []
    assert over_http.failures == [] and over_grpc.failures == []
    # Between unload and load 404, or 503 while the load after it is under way (each naming
    # why, see _expected_refusal); never a 500 or a request taken and dropped.
    assert set(over_http.codes) <= {200, 404, 503} and set(over_grpc.codes) <= {200, 404, 503}
    index = {row["name"]: row["state"] for row in http.get_model_repository_index()}
    assert index == {busy: "READY", other: "READY"}


def _http_input(images: np.ndarray) -> thttp.InferInput:
    tensor = thttp.InferInput("input", list(images.shape), "FP32")
    tensor.set_data_from_numpy(images)
    return tensor


def test_a_burst_of_unloads_waits_for_the_request_in_flight_and_then_returns(
    module_home: Path, repository: Path
) -> None:
    """More concurrent unloads than the shared thread pools have threads, while a request
    waits in the batcher: the request is answered, every unload returns. (Unloads once ran on
    the pool that encodes answers, and 6 of them starved the answer they were waiting for.)"""
    server = _start(module_home, f"--model-repository={repository}", "--max-delay-ms", "1500",
                    "--max-batch", "64")  # fmt: skip
    try:
        client = tgrpc.InferenceServerClient(_address(server))
        answered = threading.Event()
        outcome: list[Any] = []

        def on_answer(result: Any, error: Any) -> None:
            outcome.append(error)
            answered.set()

        client.async_infer(**_grpc_args(RESNET, _feeds(RESNET, 1, 0)), callback=on_answer)
        # The request is in the batcher once the queue says so: then the unloads come.
        _until(lambda: server.metric(f'kiln_queue_depth{{model="{RESNET}"}}') >= 1, "queued", 5)
        failures: list[BaseException] = []

        def unload() -> None:
            try:
                tgrpc.InferenceServerClient(_address(server)).unload_model(RESNET)
            except BaseException as exc:  # noqa: BLE001 - any failure fails the test
                failures.append(exc)

        threads = [threading.Thread(target=unload) for _ in range(12)]
        for thread in threads:
            thread.start()
        assert answered.wait(30), "the request in flight was never answered"
        assert outcome == [None]
        for thread in threads:
            thread.join(30)
        assert not any(t.is_alive() for t in threads), "an unload never returned"
        assert not failures, failures[:3]
        assert not client.is_model_ready(RESNET)
    finally:
        _stop(server)
