"""`kiln serve`: a real server process on loopback, driven by the real tritonclient[http]."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.http as triton
from string_models import strings_model

from kiln import zoo
from kiln.runtime.batcher import Batcher, Overloaded
from kiln.serve.protocol import encode_response, parse_request
from kiln.wire import ProtocolError, header_length

BERT = "bert-tiny"
RESNET = "resnet-tiny"


@dataclass
class Server:
    proc: subprocess.Popen
    ready: dict  # the line `kiln serve --json` prints once it serves: url, host, port, model

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.ready['port']}"  # host:port, as tritonclient wants it

    @property
    def base(self) -> str:
        return f"http://{self.url}"

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.base}/metrics").text
        match = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE)
        assert match, f"{name} not in /metrics"
        return float(match[1])


def _start(home: Path, model: str, *args: str) -> Server:
    """`kiln serve MODEL --port 0 --json ...`, returned once it prints that it serves."""
    cmd = [sys.executable, "-m", "kiln", "serve", model, "--port", "0", "--json", *args]
    env = {**os.environ, "KILN_HOME": str(home)}
    log = home / "serve.log"  # stderr: a file, not a pipe nobody drains
    with log.open("a") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(120)  # the line is the event; 120 s is a safety net
    if not line or not line[0]:
        proc.kill()
        pytest.fail(f"kiln serve printed no ready line: {log.read_text()}")
    return Server(proc, json.loads(line[0]))


def _until(condition: Callable[[], bool], what: str, timeout: float = 60) -> None:
    """Poll the server's state until `condition` holds: across a process boundary there is no
    event to wait on. `timeout` is a safety net only."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"waited {timeout} s for {what}")
        time.sleep(0.02)


def _stop(server: Server) -> None:
    if server.proc.poll() is None:
        server.proc.send_signal(signal.SIGINT)
        try:
            server.proc.wait(20)
        except subprocess.TimeoutExpired:
            server.proc.kill()


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> Iterator[Server]:
    home = tmp_path_factory.mktemp("serve-home")
    # A batching delay (the default is none) so concurrent requests reliably share batches.
    server = _start(
        home, f"zoo:{BERT}", "--buckets", "batch=1,4,8 seq=16,32", "--max-request-mb", "1",
        "--max-delay-ms", "5",
    )  # fmt: skip
    yield server
    _stop(server)


@functools.cache
def _ort_session(model: str) -> ort.InferenceSession:
    return ort.InferenceSession(zoo.build(model).SerializeToString())


def _reference(model: str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    return _ort_session(model).run(None, feeds)


def _bert_feeds(batch: int, seq: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, seq), np.int64)
    mask[0, seq - seq // 3 :] = 0  # a padded first row, as real traffic has
    return {
        "input_ids": rng.integers(0, 1000, (batch, seq)).astype(np.int64),
        "attention_mask": mask,
        "token_type_ids": np.zeros((batch, seq), np.int64),
    }


def _triton_infer(
    client: triton.InferenceServerClient,
    feeds: dict[str, np.ndarray],
    binary: bool,
    outputs: list[str] | None,
) -> triton.InferResult:
    inputs = []
    for name, array in feeds.items():
        tensor = triton.InferInput(name, list(array.shape), "INT64")
        tensor.set_data_from_numpy(array, binary_data=binary)
        inputs.append(tensor)
    requested = [triton.InferRequestedOutput(n, binary_data=binary) for n in outputs or []]
    return client.infer(BERT, inputs, outputs=requested or None, request_id="r1")


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_tritonclient_outputs_equal_onnxruntime(bert: Server, binary: bool) -> None:
    client = triton.InferenceServerClient(bert.url)
    assert client.is_server_live() and client.is_server_ready() and client.is_model_ready(BERT)
    meta = client.get_model_metadata(BERT)
    assert [i["name"] for i in meta["inputs"]] == ["input_ids", "attention_mask", "token_type_ids"]
    kserve = {k: meta["inputs"][0][k] for k in ("name", "datatype", "shape")}  # + max_shape
    assert kserve == {"name": "input_ids", "datatype": "INT64", "shape": [-1, -1]}
    feeds = _bert_feeds(3, 11)  # padded to the batch=4 seq=16 bucket, sliced back
    want = _reference(BERT, feeds)
    # Both outputs named, and none named (then the server sends every output in binary).
    for outputs in (["last_hidden_state", "pooler_output"], None):
        result = _triton_infer(client, feeds, binary, outputs)
        assert result.get_response()["id"] == "r1"
        for name, expected in zip(["last_hidden_state", "pooler_output"], want, strict=True):
            got = result.as_numpy(name)
            assert got.shape == expected.shape and got.dtype == np.float32
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_concurrent_requests_are_batched_and_answered_correctly(bert: Server) -> None:
    shapes = [(1, 5), (2, 16), (1, 30), (3, 9), (1, 16), (2, 20), (1, 1), (4, 12)] * 2
    feeds = [_bert_feeds(b, s, seed=i) for i, (b, s) in enumerate(shapes)]

    def call(f: dict[str, np.ndarray]) -> np.ndarray:
        client = triton.InferenceServerClient(bert.url)  # one per thread: not thread-safe
        return _triton_infer(client, f, True, ["pooler_output"]).as_numpy("pooler_output")

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(call, feeds))
    for f, got in zip(feeds, results, strict=True):
        np.testing.assert_allclose(got, _reference(BERT, f)[1], rtol=1e-4, atol=1e-5)
    assert bert.metric("kiln_batch_requests_count") < bert.metric("kiln_requests_total")


def _post(server: Server, body: bytes | str, model: str = BERT, **headers: str) -> httpx.Response:
    return httpx.post(f"{server.base}/v2/models/{model}/infer", content=body, headers=headers)


def _json_request(**override: dict) -> str:
    tensors = {
        name: {"name": name, "datatype": "INT64", "shape": [1, 4], "data": [0, 1, 1, 0]}
        for name in ["input_ids", "attention_mask", "token_type_ids"]
    }
    for name, fields in override.items():
        tensors[name].update(fields)
    return json.dumps({"inputs": list(tensors.values())})


def test_bad_requests_answer_400_in_kserve_form(bert: Server) -> None:
    response = _post(bert, _json_request())
    assert response.status_code == 200, response.text
    cases = {
        '{"inputs": [': "malformed JSON",
        '{"outputs": []}': "'inputs' list",
        _json_request(input_ids={"datatype": "FP32", "data": [0.5] * 4}): (
            "input 'input_ids' has datatype FP32, expected INT64 with shape [-1, -1]"
        ),
        _json_request(input_ids={"shape": [4]}): (
            "input 'input_ids' has shape [4], expected INT64 with shape [-1, -1]"
        ),
        _json_request(input_ids={"shape": [1, 5]}): "shape [1, 5] needs 5 values, the data has 4",
        _json_request(input_ids={"name": "ids"}): "unknown input 'ids'",
        # The name is checked before the data: an unknown input's data means nothing.
        _json_request(input_ids={"name": "z", "shape": [64], "data": []}): "unknown input 'z'",
        _json_request(attention_mask={"shape": [2, 2]}): "disagree on the batch size",
        # Triton refuses floats for integer inputs; truncating 1.7 to 1 would answer wrongly.
        _json_request(input_ids={"data": [1.7, 2, 3, 4]}): (
            "input 'input_ids': data holds 1.7; INT64 takes JSON integers only"
        ),
    }
    for body, message in cases.items():
        response = _post(bert, body)
        assert response.status_code == 400, (body, response.text)
        assert message in response.json()["error"], (body, response.text)


def _bert_json(seq: int) -> str:
    names = ["input_ids", "attention_mask", "token_type_ids"]
    return _json_request(**{n: {"shape": [1, seq], "data": [0] * seq} for n in names})


def test_a_request_past_the_models_limit_is_refused_naming_input_dim_and_limit(bert) -> None:
    (table,) = [
        t for t in zoo.build(BERT).graph.initializer
        if t.name == "embeddings.position_embeddings.weight"
    ]  # fmt: skip
    limit = int(table.dims[0])  # the model's position table: the longest sequence it takes
    meta = httpx.get(f"{bert.base}/v2/models/{BERT}").json()
    assert {i["name"]: i["max_shape"] for i in meta["inputs"]}["input_ids"] == [-1, limit]
    response = _post(bert, _bert_json(limit + 1))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert f"input 'input_ids' has seq={limit + 1}" in error and f"at most seq={limit}" in error
    assert bert.metric('kiln_request_failures_total{code="400",model="bert-tiny"}') >= 1
    assert _post(bert, _bert_json(limit)).status_code == 200


def test_refused_large_requests_leave_the_servers_memory_where_the_first_left_it(tmp_path):
    import psutil

    server = _start(tmp_path, f"zoo:{BERT}")  # the default 64 MiB request limit
    body = _bert_json(1_200_000)  # 10.8 MB of JSON, tens of MB decoded, refused by the limit
    try:
        rss = []
        for _ in range(6):  # one per server thread that may decode it, and more
            assert _post(server, body).status_code == 400
            rss.append(psutil.Process(server.proc.pid).memory_info().rss)
    finally:
        _stop(server)
    assert max(rss[1:]) <= 1.10 * rss[0], [r >> 20 for r in rss]


def test_oversize_unknown_model_and_metrics(bert: Server) -> None:
    big = np.zeros((1, 200_000), np.int64)  # 1.6 MB of binary data, over --max-request-mb 1
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "input_ids",
                    "datatype": "INT64",
                    "shape": [1, 200_000],
                    "parameters": {"binary_data_size": big.nbytes},
                }
            ]
        }
    ).encode()
    response = _post(
        bert, header + big.tobytes(), **{"Inference-Header-Content-Length": str(len(header))}
    )
    assert response.status_code == 413
    assert "--max-request-mb" in response.json()["error"]

    response = _post(bert, _json_request(), model="nope")
    assert response.status_code == 404
    assert response.json() == {"error": "unknown model 'nope'; this server serves 'bert-tiny'"}
    assert httpx.get(f"{bert.base}/v2/models/nope/ready").status_code == 404
    extensions = httpx.get(f"{bert.base}/v2").json()["extensions"]
    assert sorted(extensions) == ["binary_tensor_data", "model_configuration", "statistics"]

    text = httpx.get(f"{bert.base}/metrics").text
    for name in [
        "kiln_requests_total",
        "kiln_request_failures_total",
        "kiln_request_latency_seconds_bucket",
        "kiln_queue_time_seconds_bucket",
        "kiln_batch_size_bucket",
        "kiln_bucket_hits_total",
        "kiln_bucket_misses_total",
        "kiln_padding_waste_ratio",
        "kiln_bucket_recompiles_total",
        "kiln_bucket_swaps_total",
    ]:
        assert name in text, name
    assert bert.metric('kiln_request_failures_total{code="413",model="bert-tiny"}') >= 1
    # The server's memory: now, and the peak a machine must have free for it.
    resident = bert.metric("process_resident_memory_bytes")
    peak = bert.metric("kiln_process_peak_resident_memory_bytes")
    assert 50 * 2**20 < resident <= peak < 4 * 2**30


def test_swap_while_serving(bert: Server) -> None:
    stop, failures, answered = threading.Event(), [], [0]

    def traffic() -> None:
        client = triton.InferenceServerClient(bert.url)
        while not stop.is_set():
            try:
                _triton_infer(client, _bert_feeds(2, 13), True, ["pooler_output"])
                answered[0] += 1
            except Exception as exc:  # noqa: BLE001 - any failure fails the test below
                failures.append(exc)

    thread = threading.Thread(target=traffic)
    thread.start()
    try:
        response = httpx.post(
            f"{bert.base}/v2/models/{BERT}/swap", json={"buckets": "batch=1,2,4 seq=16"}, timeout=60
        )
    finally:
        stop.set()
        thread.join()
    assert response.status_code == 200, response.text
    assert response.json()["swapped"] and response.json()["stats"]["bucket_set"]["seq"] == [16]
    assert not failures and answered[0] > 0
    assert bert.metric("kiln_bucket_swaps_total") >= 1
    runtime = httpx.get(f"{bert.base}/v2/models/{BERT}/runtime").json()
    assert runtime["bucket_set"] == {"batch": [1, 2, 4], "seq": [16]}
    assert any(d["action"].startswith("swapped") for d in runtime["decisions"])


def test_swap_refuses_malformed_bodies_with_400(bert: Server) -> None:
    url = f"{bert.base}/v2/models/{BERT}/swap"
    for body in ['{"buckets": 5}', '{"buckets": {"batch": 4}}', '{"wait": "yes"}', "[" * 5000,
                 '{"buckets": "batch=x"}', "1" * 5000]:  # fmt: skip
        response = httpx.post(url, content=body)
        assert response.status_code == 400, (body[:40], response.text)
        assert response.json()["error"]
    # A bucket no request could fill (and whose warm-up would take gigabytes) is refused.
    response = httpx.post(url, json={"buckets": "batch=100000000 seq=16"}, timeout=30)
    assert response.status_code == 400 and "MiB" in response.json()["error"], response.text


def _resnet_request(batch: int = 1) -> bytes:
    data = np.random.default_rng(0).random((batch, 3, 32, 32), dtype=np.float32)
    return json.dumps(
        {"inputs": [{"name": "input", "datatype": "FP32", "shape": list(data.shape),
                     "data": data.ravel().tolist()}]}
    ).encode()  # fmt: skip


def test_overload_answers_503(tmp_path) -> None:
    # A long batching delay keeps requests queued, so a burst deterministically overflows.
    server = _start(
        tmp_path, f"zoo:{RESNET}", "--max-queue", "2", "--max-batch", "64", "--max-delay-ms", "2000"
    )
    try:
        body = _resnet_request()
        with ThreadPoolExecutor(8) as pool:
            responses = list(pool.map(lambda _: _post(server, body, RESNET), range(8)))
    finally:
        _stop(server)
    codes = sorted(r.status_code for r in responses)
    assert set(codes) == {200, 503} and codes.count(200) >= 2, codes
    refused = next(r for r in responses if r.status_code == 503)
    assert "server overloaded" in refused.json()["error"]
    assert "--max-queue" in refused.json()["error"]
    assert refused.headers["Retry-After"] == "1"  # when to try again


def test_shutdown_answers_queued_requests(tmp_path) -> None:
    # A long batching delay (well beyond the wait below) holds the requests in the queue
    # when the signal comes.
    server = _start(tmp_path, f"zoo:{RESNET}", "--max-batch", "64", "--max-delay-ms", "4000")
    body = _resnet_request(2)
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(_post, server, body, RESNET) for _ in range(4)]
        _until(lambda: server.metric("kiln_queue_depth") >= 4, "4 queued requests", timeout=3)
        server.proc.send_signal(signal.SIGTERM)
        responses = [f.result(timeout=30) for f in futures]
    assert [r.status_code for r in responses] == [200] * 4
    sent = json.loads(body)["inputs"][0]["data"]
    want = _reference(RESNET, {"input": np.asarray(sent, np.float32).reshape(2, 3, 32, 32)})[0]
    np.testing.assert_allclose(
        np.asarray(responses[0].json()["outputs"][0]["data"]).reshape(2, 10), want, atol=1e-4
    )
    assert server.proc.wait(20) == 0


def test_bad_model_or_settings_exit_2_with_one_line(tmp_path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = str(taken.getsockname()[1])
        # The port and host are checked before the model loads: nothere.onnx is never reached.
        for args, message in [
            (["nothere.onnx"], "nothere.onnx: no such file"),
            (["zoo:bert-tiny", "--buckets", "foo=1"], "buckets name dim 'foo'"),
            (["zoo:bert-tiny", "--max-queue", "0"], "--max-queue must be at least 1"),
            (["nothere.onnx", "--port", "99999"], "--port 99999: use a port from 1 to 65535"),
            (["nothere.onnx", "--port", "-1"], "--port -1: use a port from 1 to 65535"),
            (["nothere.onnx", "--port", busy], f"--port {busy}: the port is in use"),
            (["nothere.onnx", "--host", "no.such.host.invalid"], "--host no.such.host.invalid"),
        ]:
            done = subprocess.run(
                [sys.executable, "-m", "kiln", "serve", *args],
                capture_output=True,
                text=True,
                env={**os.environ, "KILN_HOME": str(tmp_path)},
                timeout=120,
            )
            assert done.returncode == 2 and message in done.stderr, (args, done.stderr)
            assert len(done.stderr.strip().splitlines()) == 1, done.stderr  # no 'serving' line
            assert done.stdout == ""


def test_port_0_json_prints_the_bound_port_when_ready(tmp_path) -> None:
    server = _start(tmp_path, f"zoo:{RESNET}")  # --port 0 --json
    try:
        ready = server.ready
        assert set(ready) == {"url", "host", "port", "grpc_port", "model"}
        assert ready["host"] == "127.0.0.1" and ready["model"] == RESNET and ready["port"] > 0
        assert ready["url"] == f"http://127.0.0.1:{ready['port']}/v2/models/{RESNET}"
        # Printed once serving: the server is ready at once, no polling needed.
        assert httpx.get(f"{ready['url']}/ready").status_code == 200
    finally:
        server.proc.send_signal(signal.SIGINT)
        out, _ = server.proc.communicate(timeout=30)
    assert server.proc.returncode == 0 and out == ""  # stdout holds that one line only


def test_bytes_inputs_and_outputs_with_tritonclient(tmp_path) -> None:
    server = _start(tmp_path, str(strings_model(tmp_path / "strings.onnx")))
    try:
        client = triton.InferenceServerClient(server.url)
        meta = client.get_model_metadata("strings")
        assert meta["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
        words = ["kiln", "héllo wörld", "", "日本語", "nul\x00byte"]
        ascii_upper = str.maketrans("abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ")
        want = [w.translate(ascii_upper) for w in words]  # the C locale: ASCII only
        for binary in (False, True):
            tensor = triton.InferInput("text", [len(words)], "BYTES")
            tensor.set_data_from_numpy(np.array(words, dtype=object), binary_data=binary)
            outputs = [
                triton.InferRequestedOutput(n, binary_data=binary) for n in ("upper", "count")
            ]
            result = client.infer("strings", [tensor], outputs=outputs)
            got = [w.decode() if isinstance(w, bytes) else w for w in result.as_numpy("upper")]
            assert got == want, binary
            assert result.as_numpy("count").tolist() == [len(words)]
        # Bytes that are not UTF-8 (ONNX strings are) are refused, naming the element.
        tensor = {"name": "text", "datatype": "BYTES", "shape": [2]}
        header = json.dumps({"inputs": [{**tensor, "parameters": {"binary_data_size": 10}}]})
        blob = struct.pack("<I", 1) + b"a" + struct.pack("<I", 1) + b"\xff"
        length = {"Inference-Header-Content-Length": str(len(header))}
        response = _post(server, header.encode() + blob, "strings", **length)
        assert response.status_code == 400
        assert "input 'text': element 1 is not UTF-8 text" in response.json()["error"]
    finally:
        _stop(server)


# ---------------------------------------------------------------- in-process units


def test_batcher_batches_up_to_max_batch_and_isolates_failures() -> None:
    calls: list[int] = []

    def run_batch(requests: list[dict[str, np.ndarray]]) -> list[list[np.ndarray]]:
        calls.append(sum(len(r["x"]) for r in requests))
        if any(r["x"][0] < 0 for r in requests):
            raise ValueError("negative")
        return [[r["x"] * 2] for r in requests]

    batcher = Batcher(run_batch, max_batch=4, max_delay=0.2, max_queue=3)
    futures = [batcher.submit({"x": np.array([i, i])}) for i in range(2)]
    bad = batcher.submit({"x": np.array([-1])})
    with pytest.raises(Overloaded):
        batcher.submit({"x": np.array([9])})
    batcher.start()
    batcher.close()  # drains: everything queued is answered
    assert [f.result()[0].tolist() for f in futures] == [[0, 0], [2, 2]]
    with pytest.raises(ValueError, match="negative"):
        bad.result()
    assert calls[0] == 4  # the two good requests (2 samples each) batched together


@pytest.mark.parametrize(
    ("datatype", "data", "message"),
    [
        ("INT32", [1.0, 2], "data holds 1.0; INT32 takes JSON integers only"),
        ("UINT8", ["a", "b"], "data holds 'a'; UINT8 takes JSON integers only"),
        ("BOOL", [1, 0], "BOOL takes true/false"),
    ],
)
def test_json_numbers_of_the_wrong_kind_are_refused(datatype, data, message) -> None:
    header = {"inputs": [{"name": "x", "datatype": datatype, "shape": [2], "data": data}]}
    with pytest.raises(ProtocolError, match=message):
        parse_request(json.dumps(header).encode(), None)
    good = {"inputs": [{"name": "x", "datatype": "INT32", "shape": [2], "data": [1, 2]}]}
    assert parse_request(json.dumps(good).encode(), None).inputs["x"].tolist() == [1, 2]


def test_protocol_binary_sizes_are_checked() -> None:
    def body(size: int) -> tuple[bytes, int]:
        tensor = {"name": "x", "datatype": "FP32", "shape": [2]}
        header = json.dumps({"inputs": [{**tensor, "parameters": {"binary_data_size": size}}]})
        return header.encode() + bytes(size), len(header)

    with pytest.raises(ProtocolError, match="binary_data_size is 12 bytes"):
        parse_request(*body(12))
    request = parse_request(*body(8))
    assert request.inputs["x"].tolist() == [0.0, 0.0]
    content, length = encode_response("m", request, {"y": np.ones(2, np.float32)})
    assert length is None and json.loads(content)["outputs"][0]["data"] == [1.0, 1.0]


def _elements(*words: bytes) -> bytes:
    return b"".join(struct.pack("<I", len(w)) + w for w in words)


def _bytes_body(blob: bytes, count: int) -> tuple[bytes, int]:
    tensor = {"name": "s", "datatype": "BYTES", "shape": [count]}
    header = json.dumps({"inputs": [{**tensor, "parameters": {"binary_data_size": len(blob)}}]})
    return header.encode() + blob, len(header)


def test_protocol_bytes_round_trip_and_refusals() -> None:
    request = parse_request(*_bytes_body(_elements(b"ab", b"", "é".encode()), 3))
    assert request.inputs["s"].dtype == object and request.inputs["s"].tolist() == ["ab", "", "é"]
    text = {"inputs": [{"name": "s", "datatype": "BYTES", "shape": [1, 2], "data": ["x", "y"]}]}
    assert parse_request(json.dumps(text).encode(), None).inputs["s"].tolist() == [["x", "y"]]

    out = np.array(["A", "日本"], dtype=object)
    request.outputs = {"o": True}
    content, length = encode_response("m", request, {"o": out})
    assert json.loads(content[:length])["outputs"][0]["datatype"] == "BYTES"
    assert content[length:] == _elements(b"A", "日本".encode())
    request.outputs = {"o": False}
    response = json.loads(encode_response("m", request, {"o": out})[0])
    assert response["outputs"][0]["data"] == ["A", "日本"]

    for blob, count, message in [
        (struct.pack("<I", 9) + b"ab", 1, "element 0 declares 9 bytes, but only 2"),
        (_elements(b"a") + b"xy", 2, "element 1 is cut short"),
        (_elements(b"a", b"b"), 1, "shape \\[1\\] needs 1 values, the data has 2"),
    ]:
        with pytest.raises(ProtocolError, match=message):
            parse_request(*_bytes_body(blob, count))
    for data, message in [
        (["a", 1], "element 1 is 1; BYTES takes JSON strings"),
        (["\ud800", "b"], "element 0 is not valid Unicode text"),
        (["a"], "shape \\[2\\] needs 2 values, the data has 1"),
    ]:
        header = {"inputs": [{"name": "s", "datatype": "BYTES", "shape": [2], "data": data}]}
        with pytest.raises(ProtocolError, match=message):
            parse_request(json.dumps(header).encode(), None)


@pytest.mark.parametrize(
    ("tensor", "message"),
    [
        ({"datatype": ["INT64"]}, "unsupported datatype \\['INT64'\\]"),
        ({"shape": [0, 2**62, 2**62], "data": []}, "cannot be a tensor"),
        ({"shape": [True, 2]}, "'shape' must be a list of non-negative integers"),
        ({"shape": [1] * 40}, "shape has 40 dims"),
        ({"data": [[1], [2, 3]]}, "evenly nested"),
        ({"data": [2**70, 1]}, "out of INT64's range"),
        ({"data": None}, "data holds None"),
    ],
)
def test_protocol_refuses_hostile_tensors_with_a_message(tensor, message) -> None:
    spec = {"name": "x", "datatype": "INT64", "shape": [2], "data": [1, 2], **tensor}
    with pytest.raises(ProtocolError, match=message):
        parse_request(json.dumps({"inputs": [spec]}).encode(), None)


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"[" * 100_000, "nested too deeply"),
        (b"1" * 5000, "malformed JSON"),
        (b'{"inputs": [], "outputs": 7}', "'outputs' must be a list"),
        (b'{"inputs": [], "id": {"a": 1}}', "'id' must be a string"),
    ],
)
def test_protocol_refuses_hostile_json(body, message) -> None:
    with pytest.raises(ProtocolError, match=message):
        parse_request(body, None)


@pytest.mark.parametrize("value", ["²", "-4", "1e3", "9" * 5000, "0x10"])
def test_inference_header_length_must_be_a_byte_count(value) -> None:
    with pytest.raises(ProtocolError, match="must be a byte count"):
        header_length(value)
    assert header_length(" 12 ") == 12 and header_length(None) is None


def test_bytes_elements_are_text_where_utf8_and_kept_as_bytes_otherwise() -> None:
    # BYTES carries any bytes (an encoded image for a pipeline); only a model whose input is
    # ONNX text refuses what is not UTF-8 (test_string_tensors... checks the 400).
    parsed = parse_request(*_bytes_body(_elements(b"ab", b"\xff\xd8"), 2))
    assert list(parsed.inputs["s"]) == ["ab", b"\xff\xd8"]
