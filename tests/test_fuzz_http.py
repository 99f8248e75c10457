"""`kiln serve` under hostile HTTP: a seeded mutator turns valid KServe v2 requests (JSON and
binary, numbers and strings) into broken ones, and every answer must be a 4xx (or 503) that
names the problem, never a 500 or a hang, with a valid request right after answered correctly.

The server is the real one (uvicorn, its h11 protocol and the app) on an ephemeral loopback
port, in this process, so its error log can be watched: a traceback there fails the test even
if the client never saw it. Half-sent requests go over raw sockets.
"""

from __future__ import annotations

import copy
import gzip
import json
import logging
import random
import re
import socket
import struct
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import h11
import httpx
import numpy as np
import pytest
from string_models import strings_model

from kiln.runtime import Session
from kiln.serve.app import create_app
from kiln.serve.server import bind, http_server

BERT = "bert-tiny"
STRINGS = "strings"
LIMIT = 1 << 20  # max_request_bytes of the servers under test: huge bodies cost little
BODY_TIMEOUT = 1.0  # seconds a body may take to arrive
HEAD_TIMEOUT = 1  # seconds a request head may take (uvicorn's keep-alive timeout)
# What a fuzzed request may be answered with. 405: a wrong method on a known path; the
# 400 of uvicorn itself (text, not JSON) only for bytes that are not HTTP at all.
ALLOWED = {200, 400, 404, 405, 408, 413, 503}


# ---------------------------------------------------------------- the server under test


@dataclass
class Live:
    name: str
    base: str
    port: int
    errors: list[logging.LogRecord]

    def url(self, model: str | None = None) -> str:
        return f"{self.base}/v2/models/{model or self.name}/infer"

    def metric(self, text: str) -> float:
        for line in httpx.get(f"{self.base}/metrics").text.splitlines():
            if line.startswith(text + " "):
                return float(line.split()[-1])
        return 0.0


class _Errors(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def serving(session: Session, name: str) -> Iterator[Live]:
    """The real server on 127.0.0.1:0 in a thread; its errors (uvicorn's and asyncio's) kept."""
    sock = bind("127.0.0.1", 0)
    app = create_app(
        session, name, max_batch=8, max_request_bytes=LIMIT, body_timeout_s=BODY_TIMEOUT
    )
    ready = threading.Event()
    server = http_server(app, timeout_keep_alive=HEAD_TIMEOUT, on_ready=ready.set)
    errors = _Errors()  # after http_server: uvicorn's logging setup drops earlier handlers
    loggers = [logging.getLogger(n) for n in ("uvicorn.error", "asyncio")]
    for logger in loggers:
        logger.addHandler(errors)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    assert ready.wait(60), "the server did not start"
    try:
        yield Live(name, f"http://127.0.0.1:{sock.getsockname()[1]}", sock.getsockname()[1],
                   errors.records)  # fmt: skip
    finally:
        server.should_exit = True
        thread.join(30)
        for logger in loggers:
            logger.removeHandler(errors)


@pytest.fixture(scope="module")
def bert(module_home) -> Iterator[Live]:
    # Buckets, so padding and routing meet the odd shapes too.
    with serving(Session(f"zoo:{BERT}", buckets="batch=1,4 seq=8,16"), BERT) as live:
        yield live


@pytest.fixture(scope="module")
def strings(module_home) -> Iterator[Live]:
    with serving(Session(strings_model(module_home / "strings.onnx")), STRINGS) as live:
        yield live


# ---------------------------------------------------------------- valid requests


@dataclass
class Request:
    """One HTTP request: a KServe header (None once the body is raw bytes), binary tensors
    after it, and the HTTP parts around them."""

    header: dict[str, Any] | None
    blobs: list[bytes] = field(default_factory=list)
    raw: bytes | None = None  # the body, once a byte-level mutation has replaced it
    headers: dict[str, str] = field(default_factory=dict)
    model: str | None = None
    method: str = "POST"
    path: str | None = None  # instead of /v2/models/{name}/infer; {name}: the served model

    def body(self) -> bytes:
        if self.raw is not None:
            return self.raw
        text = re.sub(rb'"deep:(\d+)"', _deep, json.dumps(self.header).encode())
        if self.blobs and "Inference-Header-Content-Length" not in self.headers:
            self.headers["Inference-Header-Content-Length"] = str(len(text))
        return text + b"".join(self.blobs)


def _tensor(name: str, array: np.ndarray, datatype: str, binary: bool) -> tuple[dict, bytes]:
    spec: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
    if not binary:
        spec["data"] = array.ravel().tolist()
        return spec, b""
    if datatype == "BYTES":
        blob = b"".join(struct.pack("<I", len(s.encode())) + s.encode() for s in array.ravel())
    else:
        blob = array.tobytes()
    spec["parameters"] = {"binary_data_size": len(blob)}
    return spec, blob


def bert_request(rng: random.Random, binary: bool) -> Request:
    batch, seq = rng.randint(1, 3), rng.randint(1, 12)
    ids = np.array([[rng.randrange(1000) for _ in range(seq)] for _ in range(batch)], np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": 0 * ids}
    specs, blobs = zip(*(_tensor(n, a, "INT64", binary) for n, a in feeds.items()), strict=True)
    header: dict[str, Any] = {"id": f"r{rng.randrange(100)}", "inputs": list(specs)}
    if rng.random() < 0.5:
        header["outputs"] = [
            {"name": "pooler_output", "parameters": {"binary_data": rng.random() < 0.5}}
        ]
    return Request(header, [b for b in blobs if b])


_WORDS = ["kiln", "héllo", "", "a b", "日本語", "tab\tnew\nline", "x" * 50, "nul\x00in"]


def strings_request(rng: random.Random, binary: bool) -> Request:
    words = np.array([rng.choice(_WORDS) for _ in range(rng.randint(1, 5))], dtype=object)
    spec, blob = _tensor("text", words, "BYTES", binary)
    header: dict[str, Any] = {"inputs": [spec]}
    if rng.random() < 0.5:
        header["parameters"] = {"binary_data_output": True}
    return Request(header, [blob] if blob else [])


def send(client: httpx.Client, live: Live, request: Request) -> httpx.Response:
    body = request.body()
    path = request.path.replace("{name}", live.name) if request.path else None
    url = f"{live.base}{path}" if path else live.url(request.model)
    headers = {k: v.encode("latin-1") for k, v in request.headers.items()}  # '²' too
    return client.request(request.method, url, content=body, headers=headers)


def outputs_of(response: httpx.Response) -> dict[str, np.ndarray]:
    """The response's tensors, JSON or binary, as numpy arrays."""
    length = response.headers.get("inference-header-content-length")
    content = response.content
    header = json.loads(content[: int(length)] if length else content)
    blob, offset, out = content[int(length) if length else len(content) :], 0, {}
    for spec in header["outputs"]:
        size = (spec.get("parameters") or {}).get("binary_data_size")
        if size is None:
            data = spec["data"]
        elif spec["datatype"] == "BYTES":
            data, end = [], offset + size
            while offset < end:
                (n,) = struct.unpack_from("<I", blob, offset)
                data.append(blob[offset + 4 : offset + 4 + n].decode())
                offset += 4 + n
        else:
            dtype = {"FP32": np.float32, "INT64": np.int64}[spec["datatype"]]
            data = np.frombuffer(blob[offset : offset + size], dtype)
            offset += size
        out[spec["name"]] = np.asarray(data, dtype=object if spec["datatype"] == "BYTES" else None)
        out[spec["name"]] = out[spec["name"]].reshape(spec["shape"])
    return out


def expected(live: Live, request: Request) -> dict[str, np.ndarray]:
    """What the model must answer: from the request's own tensors, run on a plain ORT session
    (numbers) or Python (strings, whose model upper-cases ASCII)."""
    assert request.header is not None
    feeds = {}
    blobs = iter(request.blobs)
    for spec in request.header["inputs"]:
        if "data" in spec:
            data = spec["data"]
        elif spec["datatype"] == "BYTES":
            blob, data, offset = next(blobs), [], 0
            while offset < len(blob):
                (n,) = struct.unpack_from("<I", blob, offset)
                data.append(blob[offset + 4 : offset + 4 + n].decode())
                offset += 4 + n
        else:
            data = np.frombuffer(next(blobs), np.int64)
        feeds[spec["name"]] = np.asarray(data).reshape(spec["shape"])
    if live.name == STRINGS:
        words = feeds["text"].astype(object)
        upper = np.array([w.translate(_ASCII_UPPER) for w in words], dtype=object)
        return {"upper": upper, "count": np.array([len(words)], np.int64)}
    return dict(
        zip(["last_hidden_state", "pooler_output"], _bert_ort().run(None, feeds), strict=True)
    )


_ASCII_UPPER = str.maketrans("abcdefghijklmnopqrstuvwxyz", "ABCDEFGHIJKLMNOPQRSTUVWXYZ")
_ORT: list[Any] = []


def _bert_ort() -> Any:
    if not _ORT:
        import onnxruntime as ort

        from kiln import zoo

        _ORT.append(ort.InferenceSession(zoo.build(BERT).SerializeToString()))
    return _ORT[0]


def check_answered_correctly(client: httpx.Client, live: Live, request: Request) -> None:
    response = send(client, live, request)
    assert response.status_code == 200, response.text
    got, want = outputs_of(response), expected(live, request)
    for name, array in got.items():
        if array.dtype == object:
            assert array.tolist() == want[name].tolist(), name
        else:
            np.testing.assert_allclose(array, want[name], rtol=1e-4, atol=1e-5, err_msg=name)


# ---------------------------------------------------------------- the mutator

# Values that break assumptions: wrong types, boundaries, sizes.
NASTY: list[Any] = [
    None, True, False, 0, -1, 1, 1.5, -0.0, 2**31, 2**63, 2**64, -(2**63) - 1, 10**40,
    float("inf"), float("nan"), "", "x", "x" * 5000, "INT64", "BYTES", "FP32", "BF16", "²",
    [], [[]], [None], [1, [2]], [-1], [0], [2**62, 2**62], [1] * 70, {}, {"name": 1},
    {"binary_data_size": -4}, "\ud800", "日本",
]  # fmt: skip


def _nasty(rng: random.Random) -> Any:
    return copy.deepcopy(rng.choice(NASTY))  # a copy: mutators change what they insert


def _nested(depth: int) -> str:
    """A marker the body's JSON replaces with a list nested `depth` deep: deeper than the
    client's own json.dumps could write."""
    return f"deep:{depth}"


def _deep(match: re.Match) -> bytes:
    depth = int(match[1])
    return b"[" * depth + b"1" + b"]" * depth


def _paths(obj: Any, here: tuple = ()) -> Iterator[tuple]:
    """Every JSON path (keys and indices) into obj, obj itself first; lists past 8 items are
    sampled by their first and last, so a big tensor's data does not dominate."""
    yield here
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _paths(value, (*here, key))
    elif isinstance(obj, list):
        indices = range(len(obj)) if len(obj) <= 8 else [0, len(obj) - 1]
        for i in indices:
            yield from _paths(obj[i], (*here, i))


def _get(obj: Any, path: tuple) -> Any:
    for key in path:
        obj = obj[key]
    return obj


def _set(obj: Any, path: tuple, value: Any) -> None:
    _get(obj, path[:-1])[path[-1]] = value


def _container_paths(header: dict) -> list[tuple]:
    return [p for p in _paths(header) if isinstance(_get(header, p), dict | list)]


def m_replace(rng: random.Random, r: Request) -> None:
    """Any value anywhere in the header becomes a nasty one."""
    paths = [p for p in _paths(r.header) if p]
    if not paths:  # an empty header: nothing left to break this way
        return
    path = rng.choice(paths)
    deep = rng.random() < 0.1
    _set(r.header, path, _nested(rng.choice([40, 70, 3000])) if deep else _nasty(rng))


def m_drop(rng: random.Random, r: Request) -> None:
    """A key or list item disappears."""
    paths = [p for p in _paths(r.header) if p]
    if not paths:  # an empty header: nothing left to break this way
        return
    path = rng.choice(paths)
    del _get(r.header, path[:-1])[path[-1]]


def m_add(rng: random.Random, r: Request) -> None:
    """An unknown key or an extra item appears."""
    target = _get(r.header, rng.choice(_container_paths(r.header)))
    value = _nasty(rng)
    if isinstance(target, dict):
        target[rng.choice(["extra", "parameters", "outputs", "data", "shape", "name"])] = value
    else:
        target.insert(rng.randint(0, len(target)), value)


def _inputs(r: Request) -> list[dict]:
    inputs = r.header.get("inputs") if isinstance(r.header, dict) else None
    return [i for i in inputs if isinstance(i, dict)] if isinstance(inputs, list) else []


def m_shape(rng: random.Random, r: Request) -> None:
    """A declared shape far beyond (or short of) the data, negative, empty or very deep."""
    inputs = _inputs(r)
    if not inputs:
        return m_replace(rng, r)
    spec = rng.choice(inputs)
    shape = spec.get("shape") if isinstance(spec.get("shape"), list) else [1]
    shape = [d if type(d) is int else 1 for d in shape]  # earlier mutations may put anything
    spec["shape"] = rng.choice(
        [
            [d * rng.choice([2, 1000, 2**31, 2**40]) for d in shape],
            [*shape, rng.choice([1, 0, 7])],
            shape[1:],
            [0, *shape],
            [0, 2**62, 2**62],
            [-d for d in shape],
            [],
            [1] * rng.choice([33, 65]),
            [2**63 - 1, 2],
            [3, 10**6],
        ]
    )


def m_datatype(rng: random.Random, r: Request) -> None:
    inputs = _inputs(r)
    if inputs:
        rng.choice(inputs)["datatype"] = rng.choice(
            ["BOOL", "UINT8", "INT8", "INT32", "INT64", "FP16", "FP32", "FP64", "BYTES", "BF16",
             "int64", "STRING", "", 7]
        )  # fmt: skip


def m_data(rng: random.Random, r: Request) -> None:
    """The data: cut, grown, ragged, of the wrong kind, out of range, or huge."""
    inputs = [i for i in _inputs(r) if isinstance(i.get("data"), list)]
    if not inputs:
        return m_binary_size(rng, r)
    spec = rng.choice(inputs)
    data = spec["data"]
    choice = rng.randrange(8)
    if choice == 0:
        spec["data"] = data[: rng.randrange(len(data) + 1)]
    elif choice == 1:
        spec["data"] = data + data[: rng.randint(1, 3)]
    elif choice == 2:
        spec["data"] = [data[:1], data[1:]]
    elif choice == 3 and data:
        data[rng.randrange(len(data))] = _nasty(rng)
    elif choice == 4:
        spec["data"] = [rng.choice([2**70, -1, 300, 1e300, -(2**63)]) for _ in data]
    elif choice == 5:  # huge: near or past the body limit
        spec["data"] = [1] * rng.choice([100_000, 400_000])
        spec["shape"] = rng.choice([[1, len(spec["data"])], [len(spec["data"]) // 4, 4]])
    elif choice == 6:
        spec["data"] = _nested(rng.choice([10, 60, 2000]))
    else:
        spec["data"] = [[x] for x in data]


def m_binary_size(rng: random.Random, r: Request) -> None:
    """binary_data_size lies, or the binary data itself is cut or grown."""
    sized = [i for i in _inputs(r) if isinstance(i.get("parameters"), dict)]
    if sized and rng.random() < 0.6:
        params = rng.choice(sized)["parameters"]
        size = params.get("binary_data_size")
        size = size if isinstance(size, int) else 8
        params["binary_data_size"] = rng.choice([size - 1, size + 1, 0, -size, 2**40, 1.0 * size])
    elif r.blobs:
        i = rng.randrange(len(r.blobs))
        blob = r.blobs[i]
        cut = rng.randrange(len(blob) + 1)
        r.blobs[i] = rng.choice([blob[:cut], blob + blob[:cut], _flip(rng, blob)])
    else:
        m_replace(rng, r)


def m_outputs(rng: random.Random, r: Request) -> None:
    r.header["outputs"] = rng.choice(
        [
            [{"name": "nope"}],
            [{"name": "pooler_output"}, {"name": "pooler_output"}],
            [{"name": "upper", "parameters": {"classification": 3}}],
            [{"name": 5}],
            "upper",
            {"name": "upper"},
            7,
            [{"name": "count", "parameters": "binary"}],
            [{"name": "upper", "parameters": {"binary_data": True}}],
        ]
    )


def m_inputs(rng: random.Random, r: Request) -> None:
    """Inputs duplicated, renamed, missing, or none at all."""
    inputs = r.header.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        r.header["inputs"] = rng.choice([[], None, {}, "inputs"])
        return
    choice = rng.randrange(4)
    if choice == 0:
        inputs.append(json.loads(json.dumps(inputs[0])))
    elif choice == 1 and isinstance(inputs[0], dict):
        inputs[0]["name"] = rng.choice(["nope", "", "input_ids ", "TEXT", "x" * 3000])
    elif choice == 2:
        inputs.pop(rng.randrange(len(inputs)))
    else:
        r.header["inputs"] = rng.choice([[], None, {}, "inputs", [None], [[]]])


def m_header_length(rng: random.Random, r: Request) -> None:
    """A lying Inference-Header-Content-Length."""
    length = len(json.dumps(r.header).encode()) if r.raw is None else len(r.raw) // 2
    r.headers["Inference-Header-Content-Length"] = rng.choice(
        [str(length + rng.choice([-7, -1, 1, 7])), "0", str(2**63), "-4", "abc", "²", "1e3",
         f"+{length}", "0x10", "9" * 5000, str(length * 1000)]
    )  # fmt: skip


def m_encoding(rng: random.Random, r: Request) -> None:
    """Content-Encoding: valid, lying, unknown, or a bomb."""
    body = r.body()
    choice = rng.randrange(5)
    if choice == 0:
        r.raw, r.headers["Content-Encoding"] = gzip.compress(body), "gzip"
    elif choice == 1:
        r.raw, r.headers["Content-Encoding"] = zlib.compress(body), "deflate"
    elif choice == 2:
        r.raw, r.headers["Content-Encoding"] = body, rng.choice(["gzip", "deflate"])
    elif choice == 3:
        r.headers["Content-Encoding"] = rng.choice(["br", "zstd", "GZIP", "gzip, gzip", "x" * 300])
    else:  # inflates past the limit
        r.raw, r.headers["Content-Encoding"] = gzip.compress(bytes(4 * LIMIT)), "gzip"


def _flip(rng: random.Random, data: bytes) -> bytes:
    data = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        if data:
            data[rng.randrange(len(data))] = rng.randrange(256)
    return bytes(data)


def m_bytes(rng: random.Random, r: Request) -> None:
    """The body as bytes: cut, flipped, spliced, or replaced."""
    body = r.body()
    choice = rng.randrange(7)
    if choice == 0:
        r.raw = body[: rng.randrange(len(body) + 1)]
    elif choice == 1:
        r.raw = _flip(rng, body)
    elif choice == 2:
        cut = rng.randrange(len(body) + 1)
        r.raw = (
            body[:cut] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 64))) + body[cut:]
        )
    elif choice == 3:
        r.raw = rng.choice([b"", b"null", b"[]", b'"inputs"', b"{}", b"\xff\xfe", b"1" * 6000])
    elif choice == 4:
        r.raw = b"[" * rng.choice([1000, 100_000]) + b"]" * rng.choice([0, 1000])
    elif choice == 5:  # huge and past the limit
        r.raw = b'{"inputs": [], "pad": "' + b"x" * (LIMIT + 10) + b'"}'
    else:
        r.raw = body.decode("utf-8", "replace").encode("utf-16")


def m_route(rng: random.Random, r: Request) -> None:
    """Unknown models and versions, wrong methods, other endpoints."""
    choice = rng.randrange(4)
    if choice == 0:
        r.model = rng.choice(["nope", "", "%00", "a/../b", "x" * 2000])
    elif choice == 1:
        r.path = f"/v2/models/{{name}}/versions/{rng.choice(['1', '2', 'x'])}/infer"
    elif choice == 2:
        r.method = rng.choice(["GET", "PUT", "DELETE", "PATCH"])
    else:
        r.path = rng.choice(["/v2/models/nope/ready", "/v2/x", "/metrics/x", "/v2/models//infer"])


MUTATORS: list[Callable[[random.Random, Request], None]] = [
    m_replace, m_drop, m_add, m_shape, m_datatype, m_data, m_binary_size, m_outputs, m_inputs,
    m_header_length, m_encoding, m_bytes, m_route,
]  # fmt: skip


def mutated(rng: random.Random, make: Callable[[random.Random, bool], Request]) -> Request:
    request = make(rng, rng.random() < 0.5)
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        mutate = rng.choice(MUTATORS)
        if request.raw is not None and mutate not in (m_header_length, m_encoding, m_bytes):
            continue  # structure is gone once the body is raw bytes
        if request.header is not None and not isinstance(request.header, dict):
            continue
        mutate(rng, request)
    return request


def check_refusal(response: httpx.Response, request: Request) -> None:
    """A 4xx/503 answer in KServe's form, naming the problem."""
    what = (request.method, request.path or request.model, request.headers, request.body()[:300])
    assert response.status_code in ALLOWED, (response.status_code, response.text[:500], what)
    if response.status_code != 200:
        error = response.json()["error"]
        assert isinstance(error, str) and len(error) > 10, (response.text, what)
        assert len(error) < 2000, (len(error), what)  # an echo of the request is not a message


def fuzz(live: Live, make: Callable[[random.Random, bool], Request], seed: int, count: int):
    """`count` mutated requests, each followed by a valid one that must be answered right."""
    rng = random.Random(seed)
    codes: Counter[int] = Counter()
    with httpx.Client(timeout=30) as client:
        for _ in range(count):
            request = mutated(rng, make)
            response = send(client, live, request)
            check_refusal(response, request)
            codes[response.status_code] += 1
            check_answered_correctly(client, live, make(rng, rng.random() < 0.5))
    assert not live.errors, [r.getMessage() for r in live.errors][:3]
    assert live.metric(f'kiln_request_failures_total{{code="500",model="{live.name}"}}') == 0
    return codes


@pytest.mark.parametrize(("model", "count"), [(BERT, 200), (STRINGS, 150)])
def test_fuzzed_requests_are_refused_with_a_4xx_never_a_500(request, model, count) -> None:
    live = request.getfixturevalue("bert" if model == BERT else "strings")
    make = bert_request if model == BERT else strings_request
    codes = fuzz(live, make, seed=len(model), count=count)
    print(f"{model}: {count} fuzzed requests, answers {dict(sorted(codes.items()))}")
    assert codes[500] == 0 and sum(codes.values()) == count
    assert codes[400] > count // 3  # the mutator does reach the protocol's checks


@pytest.mark.slow
@pytest.mark.parametrize(("model", "count"), [(BERT, 2000), (STRINGS, 1000)])
def test_many_fuzzed_requests(request, model, count) -> None:
    live = request.getfixturevalue("bert" if model == BERT else "strings")
    make = bert_request if model == BERT else strings_request
    codes = fuzz(live, make, seed=1000 + len(model), count=count)
    print(f"{model}: {count} fuzzed requests, answers {dict(sorted(codes.items()))}")
    assert codes[500] == 0 and sum(codes.values()) == count


# ---------------------------------------------------------------- half-sent and broken HTTP


def _head(live: Live, body: bytes, **headers: str) -> bytes:
    lines = [f"POST /v2/models/{live.name}/infer HTTP/1.1", "Host: fuzz"]
    lines += [f"{k}: {v}" for k, v in {"Content-Length": str(len(body)), **headers}.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def exchange(live: Live, data: bytes, close_after: bool = False) -> list[Any]:
    """Send raw bytes; the h11 events of the server's first answer, up to the connection's
    close. A server that neither answers nor closes within 10 s fails the test: a hang."""
    client = h11.Connection(h11.CLIENT)
    events: list[Any] = []
    with socket.create_connection(("127.0.0.1", live.port), timeout=10) as sock:
        sock.sendall(data)
        if close_after:
            sock.shutdown(socket.SHUT_WR)
        while not events or type(events[-1]) not in (h11.EndOfMessage, h11.ConnectionClosed):
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                pytest.fail(f"the server neither answered nor closed within 10 s: {data[:200]!r}")
            except ConnectionResetError:
                chunk = b""
            client.receive_data(chunk)
            while True:
                try:
                    event = client.next_event()
                except h11.RemoteProtocolError as exc:
                    pytest.fail(f"the server's answer is not HTTP: {exc}")
                if event in (h11.NEED_DATA, h11.PAUSED):
                    break
                events.append(event)
                if type(event) in (h11.EndOfMessage, h11.ConnectionClosed):
                    break
    return events


def _until(condition: Callable[[], bool], what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"waited {timeout} s for {what}")
        time.sleep(0.02)


def _answer(events: list[Any]) -> tuple[int | None, bytes]:
    status = next((e.status_code for e in events if isinstance(e, h11.Response)), None)
    return status, b"".join(bytes(e.data) for e in events if isinstance(e, h11.Data))


def test_half_sent_body_then_closed_is_dropped_not_a_500(bert: Live) -> None:
    valid = bert_request(random.Random(1), binary=False)
    body = valid.body()
    gone = f'kiln_request_failures_total{{code="499",model="{BERT}"}}'
    before = bert.metric(gone)
    events = exchange(bert, _head(bert, body, **{"Content-Length": str(5 * len(body))})
                      + body, close_after=True)  # fmt: skip
    assert _answer(events)[0] is None  # no one left to answer
    # Counted once the server sees the close; across the socket there is no event to wait on.
    _until(lambda: bert.metric(gone) > before, "the dropped request to be counted")
    assert bert.metric(gone) == before + 1
    with httpx.Client() as client:
        check_answered_correctly(client, bert, valid)
    assert not bert.errors


def test_stalled_body_is_answered_408_and_closed_while_others_are_served(bert: Live) -> None:
    valid = bert_request(random.Random(2), binary=True)
    body = valid.body()
    head = _head(bert, body, **valid.headers, **{"Content-Length": str(len(body) + 100)})
    with socket.create_connection(("127.0.0.1", bert.port), timeout=10) as sock:
        sock.sendall(head + body)  # 100 bytes short, and the client stalls
        with httpx.Client() as client:  # meanwhile, others are served
            check_answered_correctly(client, bert, valid)
        client = h11.Connection(h11.CLIENT)
        data = b""
        while chunk := sock.recv(65536):  # the server answers, then closes: recv() sees b""
            data += chunk
        client.receive_data(data)
        response = client.next_event()
        assert response.status_code == 408
        assert (b"connection", b"close") in response.headers
        error = json.loads(bytes(client.next_event().data))["error"]
        assert f"did not arrive within {BODY_TIMEOUT:g} s" in error
    assert not bert.errors


@pytest.mark.parametrize(
    "sent",
    [b"", b"POST /v2/models/bert-tiny/infer HTTP/1.1\r\nHost: fuzz\r\nContent-Le"],
    ids=["idle", "half-head"],
)
def test_stalled_request_head_is_closed(bert: Live, sent: bytes) -> None:
    # uvicorn alone would wait for the rest of this head forever.
    with socket.create_connection(("127.0.0.1", bert.port), timeout=10) as sock:
        sock.sendall(sent)
        assert sock.recv(65536) == b""  # closed after HEAD_TIMEOUT, well within 10 s
    with httpx.Client() as client:
        check_answered_correctly(client, bert, bert_request(random.Random(3), binary=False))


def raw_mutated(rng: random.Random, live: Live) -> tuple[bytes, bool]:
    """A valid request as raw HTTP, broken at the HTTP level: framing that lies, heads that are
    not HTTP, bodies cut short. Also: whether to close our side after sending."""
    request = bert_request(rng, rng.random() < 0.5)
    body = request.body()
    headers = dict(request.headers)
    choice = rng.randrange(10)
    if choice == 0:  # Content-Length larger than the body: stalls (408) or closes
        headers["Content-Length"] = str(len(body) + rng.choice([1, 1000, 10**12]))
        return _head(live, body, **headers) + body, rng.random() < 0.5
    if choice == 1:  # shorter: the rest is read as a next request that is not HTTP
        headers["Content-Length"] = str(rng.randrange(len(body)))
    elif choice == 2:
        headers["Content-Length"] = rng.choice(["-1", "abc", "1e3", f"{len(body)}, 5", "0x10"])
    elif choice == 3:
        headers = {"Transfer-Encoding": "chunked", "Content-Length": ""}
        size = rng.choice([f"{len(body):x}", "zz", f"{len(body) + 50:x}", "-5"])
        data = _head(live, b"", **headers).replace(b"Content-Length: \r\n", b"")
        return data + size.encode() + b"\r\n" + body + b"\r\n0\r\n\r\n", True
    data = _head(live, body, **headers) + body
    if choice == 4:
        data = data[: rng.randrange(len(data))]
        return data, True
    if choice == 5:
        cut = data.index(b"\r\n\r\n")
        data = _flip(rng, data[:cut]) + data[cut:]
    elif choice == 6:
        data = data.replace(b"Host: fuzz", b"X-Big: " + b"a" * rng.choice([20_000, 200_000]))
    elif choice == 7:
        data = rng.choice([b"GARBAGE\r\n\r\n", b"\x16\x03\x01\x02\x00\x01\x00", b"\r\n" * 50,
                           b"GET / HTTP/9.9\r\n\r\n", b"POST\r\n\r\n"])  # fmt: skip
    elif choice == 8:
        data = data.replace(b"HTTP/1.1\r\n", b"HTTP/1.0\r\n", 1)
    else:
        data = data.replace(b"/infer", rng.choice([b"/infer?x=%zz", b"/inf\x00er", b"/%ff%fe"]))
    return data, False


def raw_fuzz(live: Live, seed: int, count: int) -> Counter[int | None]:
    rng = random.Random(seed)
    codes: Counter[int | None] = Counter()
    with httpx.Client(timeout=30) as client:
        for _ in range(count):
            data, close = raw_mutated(rng, live)
            status, content = _answer(exchange(live, data, close))
            assert status is None or status in ALLOWED, (status, content[:300], data[:300])
            codes[status] += 1
            check_answered_correctly(client, live, bert_request(rng, rng.random() < 0.5))
    assert not live.errors, [r.getMessage() for r in live.errors][:3]
    return codes


def test_broken_http_never_hangs_or_500s(bert: Live) -> None:
    codes = raw_fuzz(bert, seed=7, count=40)
    print(f"raw HTTP: 40 requests, answers {dict(codes)} (None: closed without an answer)")
    assert codes[500] == 0


@pytest.mark.slow
def test_much_broken_http(bert: Live) -> None:
    codes = raw_fuzz(bert, seed=8, count=400)
    print(f"raw HTTP: 400 requests, answers {dict(codes)} (None: closed without an answer)")
    assert codes[500] == 0
