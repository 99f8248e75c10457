"""`kiln.Session("edge.kiln", remote="http://host:port")`: the edge part of a `kiln split` runs
here, the server part on a `kiln serve` server, reached over KServe v2 HTTP with the binary
tensor extension (the standard library's http.client: the runtime does not import the server).

The edge artifact's manifest holds a `split` section (written by `kiln.split`): the server
part's default model name (`kiln serve DIR/server.kiln` serves it as "server"), the boundary
tensors (names, dtypes, shapes) and the whole model's outputs. `model_name` names the model
where the server serves it under another name (`kiln serve DIR/server.kiln --name NAME`, or a
repository folder NAME), so that several splits share one server. On first use the session
asks the server (GET /v2/models/NAME) whether it serves that model with those inputs; a server
that answers for another model is one KilnError, as is a server that is gone or does not
answer within `timeout` seconds — never a hang.

`link_bandwidth` (bits/s) simulates a slower link on loopback: each request also sleeps the
serialization time of the bytes it sent and received, so predicted end-to-end times can be
checked against measured ones.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.parse
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import KilnError
from kiln.runtime.metadata import NodeArg
from kiln.runtime.monitor import LATENCY_SAMPLES, percentile_ms
from kiln.runtime.parts import PartitionedSession
from kiln.runtime.session import LocalSession
from kiln.wire import (
    HEADER_LENGTH,
    ProtocolError,
    datatype_of,
    decode_tensor,
    encode_tensor,
    header_length,
)

Feeds = dict[str, np.ndarray]
# Failures of a kept-alive connection the server may have closed in between: tried once more
# on a new connection.
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)


class RemoteSession:
    """The edge part here (`local`, the session of edge.kiln), the server part at `remote` as
    model `model_name` (default: the name the split wrote); the same `run(output_names,
    feeds)`, `run_batch` and `stats` as a LocalSession, returning the server's outputs (the
    whole model's)."""

    def __init__(
        self,
        local: LocalSession | PartitionedSession,
        remote: str,
        *,
        model_name: str | None = None,
        timeout: float = 30.0,
        link_bandwidth: float | None = None,
    ) -> None:
        self.local = local
        where = str(local.artifact.path) if local.artifact is not None else "the model"
        section = _split_section(local, where)
        self.url = _base_url(remote)
        if not timeout > 0:
            raise KilnError(f"timeout={timeout}: give the seconds to wait for the server (> 0).")
        if link_bandwidth is not None and not float(link_bandwidth) > 0:
            raise KilnError(f"link_bandwidth={link_bandwidth}: give bits per second (> 0).")
        self.timeout, self.link_bandwidth = float(timeout), link_bandwidth
        if model_name is not None and not (isinstance(model_name, str) and model_name.strip()):
            raise KilnError(
                f"model_name={model_name!r}: give the name the server serves the split's "
                "server part under."
            )
        self.model = model_name or str(section["server_model"])
        self.boundary = [dict(spec) for spec in section["boundary"]]
        self._outputs = [dict(spec) for spec in section["outputs"]]
        parsed = urllib.parse.urlsplit(self.url)
        self._host, self._port = parsed.hostname or "127.0.0.1", parsed.port or 80
        self._prefix = parsed.path.rstrip("/")
        self._local_state = threading.local()
        self._checked = False
        self._check_lock = threading.Lock()
        self.bytes_sent = self.bytes_received = 0
        self._times: deque[float] = deque(maxlen=LATENCY_SAMPLES)  # recent runs, end to end
        self._requests = 0
        self._count = threading.Lock()

    # ------------------------------------------------------------------ interface

    @property
    def input_names(self) -> list[str]:
        return self.local.input_names

    @property
    def output_names(self) -> list[str]:
        return [spec["name"] for spec in self._outputs]

    def get_inputs(self) -> list[NodeArg]:
        return self.local.get_inputs()

    def get_outputs(self) -> list[NodeArg]:
        return [NodeArg(s["name"], f"tensor({_onnx_type(s['dtype'])})", list(s["shape"]))
                for s in self._outputs]  # fmt: skip

    # ------------------------------------------------------------------ running

    def run(
        self, output_names: list[str] | None, feeds: Feeds, run_options: Any = None
    ) -> list[np.ndarray]:
        """The edge part on `feeds` here, its encoded boundary posted to the server, the
        server's outputs back (those named; None: all). `run_options` goes to the edge part's
        run, as LocalSession.run takes it (its `terminate` refuses the run)."""
        started = time.perf_counter()
        names = self.output_names if output_names is None else list(output_names)
        unknown = [n for n in names if n not in self.output_names]
        if unknown:
            raise KilnError(
                f"{self.url}: no output '{unknown[0]}'; the outputs are {self.output_names}."
            )
        edge = dict(zip(self.local.output_names, self.local.run(None, feeds, run_options),
                        strict=True))  # fmt: skip
        self.check_server()
        body, length = encode_request([(s["name"], edge[s["name"]]) for s in self.boundary])
        status, headers, answer = self._request(
            "POST", f"/v2/models/{self.model}/infer", body,
            {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(length)},
        )  # fmt: skip
        if status != 200:
            raise KilnError(f"{self._where()}: the server refused the request: {_error(answer)}")
        self._simulate_link(len(body) + len(answer))
        outputs = decode_response(answer, headers.get(HEADER_LENGTH), self._where())
        missing = [n for n in names if n not in outputs]
        if missing:
            raise KilnError(f"{self._where()}: the answer has no output '{missing[0]}'.")
        self._times.append(time.perf_counter() - started)
        with self._count:
            self._requests += 1
        return [outputs[n] for n in names]

    def run_batch(
        self, requests: list[Feeds], output_names: list[str] | None = None
    ) -> list[list[np.ndarray]]:
        """Each request's outputs, in order, as LocalSession.run_batch: one after another
        (each is one round trip; the server batches what several clients send at once)."""
        return [self.run(output_names, feeds) for feeds in requests]

    def stats(self) -> dict[str, Any]:
        """As LocalSession.stats: requests answered and the end-to-end P50/P99 (ms) of recent
        ones; the edge part's own session figures (`edge`); the server and the bytes sent to
        and received from it (`remote`). No buckets, rebuilds or swaps here: the edge
        session's are under `edge`."""
        recent = self._times.copy()  # one step under the GIL, as appends are
        latency = (
            {"p50_ms": percentile_ms(recent, 50), "p99_ms": percentile_ms(recent, 99)}
            if recent
            else {}
        )
        return {
            "requests": self._requests,
            "swaps": 0,
            "recompiles": 0,
            "decisions": [],
            "buckets": {},
            "whole": {"runs": len(recent), **latency},
            "edge": self.local.stats(),
            "remote": {"url": self.url, "model": self.model, "bytes_sent": self.bytes_sent,
                       "bytes_received": self.bytes_received},
        }  # fmt: skip

    def check_server(self) -> None:
        """Once: the server serves `self.model` with the boundary tensors as its inputs."""
        if self._checked:
            return
        with self._check_lock:
            if self._checked:
                return
            status, _, answer = self._request("GET", f"/v2/models/{self.model}", None, {})
            if status == 404:
                raise KilnError(
                    f"the server at {self.url} does not serve model '{self.model}' "
                    f"({_error(answer)}); start the server part of this split there "
                    f"(kiln serve DIR/server.kiln --name {self.model}), or give model_name= "
                    "the name it is served under."
                )
            if status != 200:
                raise KilnError(f"{self._where()}: metadata request failed: {_error(answer)}")
            _check_inputs(self._parse_json(answer), self.boundary, self._where())
            self._checked = True

    def _simulate_link(self, size: int) -> None:
        if self.link_bandwidth:
            time.sleep(size * 8 / float(self.link_bandwidth))  # the link's serialization time

    def _where(self) -> str:
        return f"the server at {self.url} (model '{self.model}')"

    def _parse_json(self, answer: bytes) -> Any:
        try:
            return json.loads(answer)
        except ValueError:
            raise KilnError(f"{self._where()}: answered with something that is not JSON.") from None

    # ------------------------------------------------------------------ the connection

    def _request(
        self, method: str, path: str, body: bytes | None, headers: dict[str, str]
    ) -> tuple[int, Any, bytes]:
        """(status, headers (case-insensitive), body) of one request."""
        for attempt in (0, 1):
            connection, reused = self._connection()
            try:
                connection.request(method, self._prefix + path, body=body, headers=headers)
                response = connection.getresponse()
                answer = response.read()
            except _STALE as exc:
                self._drop()
                if reused and attempt == 0:
                    continue  # the server closed an idle kept-alive connection: once more
                raise self._gone(exc) from None
            except (TimeoutError, OSError, http.client.HTTPException) as exc:
                self._drop()
                raise self._gone(exc) from None
            self.bytes_sent += len(body or b"")
            self.bytes_received += len(answer)
            if response.getheader("Connection", "").lower() == "close":
                self._drop()
            return response.status, response.headers, answer
        raise AssertionError("unreachable")

    def _gone(self, exc: BaseException) -> KilnError:
        if isinstance(exc, TimeoutError | socket.timeout):
            return KilnError(
                f"{self._where()} did not answer within {self.timeout:g} s; check that it is "
                "up and not overloaded, or give a longer timeout=."
            )
        why = (
            exc.strerror
            if isinstance(exc, OSError) and exc.strerror
            else str(exc) or type(exc).__name__
        )
        return KilnError(
            f"{self._where()} is gone ({why}); start it with `kiln serve DIR/server.kiln` or "
            "check the address."
        )

    def _connection(self) -> tuple[http.client.HTTPConnection, bool]:
        connection = getattr(self._local_state, "connection", None)
        if connection is not None:
            return connection, True
        connection = http.client.HTTPConnection(self._host, self._port, timeout=self.timeout)
        try:
            connection.connect()
        except (TimeoutError, OSError) as exc:
            raise self._gone(exc) from None
        # Header and body are separate writes: without this, Nagle's algorithm holds the body
        # for the server's delayed ACK (40 ms a request).
        connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._local_state.connection = connection
        return connection, False

    def _drop(self) -> None:
        connection = getattr(self._local_state, "connection", None)
        self._local_state.connection = None
        if connection is not None:
            connection.close()

    def close(self) -> None:
        self._drop()
        self.local.close()

    def __enter__(self) -> RemoteSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _split_section(local: LocalSession | PartitionedSession, where: str) -> dict[str, Any]:
    """The edge artifact's `split` section, checked to be an edge part with a server."""
    path = Path(local.artifact.path) / "manifest.json" if local.artifact is not None else None
    section = None
    if path is not None:
        try:
            section = json.loads(path.read_text()).get("split")
        except (OSError, ValueError, AttributeError):
            section = None
    if not isinstance(section, dict) or section.get("role") != "edge":
        raise KilnError(
            f"{where}: remote= runs the edge part of a `kiln split` (DIR/edge.kiln); this is "
            "not one. Split the model first: kiln split MODEL -o DIR."
        )
    if not section.get("server_model"):
        raise KilnError(
            f"{where}: this split runs all on the edge (there is no server part); open it "
            "without remote=."
        )
    try:
        for spec in (*section["boundary"], *section["outputs"]):
            str(spec["name"]), str(spec["dtype"]), list(spec["shape"])
    except (KeyError, TypeError):
        raise KilnError(f"{where}: the manifest's split section is damaged; split again.") from None
    return section


def _base_url(remote: str) -> str:
    text = str(remote).strip().rstrip("/")
    if "://" not in text:
        text = f"http://{text}"
    parsed = urllib.parse.urlsplit(text)
    if parsed.scheme != "http" or not parsed.hostname:
        raise KilnError(
            f"remote={remote!r}: give the server's address as http://host:port (plain HTTP, "
            "as kiln serve listens)."
        )
    try:
        parsed.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError:
        raise KilnError(f"remote={remote!r}: the port is not a number.") from None
    return text


def _check_inputs(metadata: Any, boundary: list[dict[str, Any]], where: str) -> None:
    """The server's inputs are the boundary's, by name and datatype."""
    try:
        served = {i["name"]: i["datatype"] for i in metadata["inputs"]}
    except (KeyError, TypeError):
        raise KilnError(f"{where}: its model metadata has no inputs list.") from None
    wanted = {spec["name"]: datatype_of(spec["dtype"]) for spec in boundary}
    if served != wanted:
        raise KilnError(
            f"{where} takes inputs {served}, not this split's boundary {wanted}: it serves "
            "another model under that name. Serve the server.kiln written with this edge.kiln."
        )


def _onnx_type(dtype: str) -> str:
    return {"float32": "float", "float64": "double"}.get(dtype, dtype)


def encode_request(tensors: list[tuple[str, np.ndarray]]) -> tuple[bytes, int]:
    """A binary-extension inference request: the JSON header, then the raw tensors; all
    outputs asked back binary."""
    specs, blobs = [], []
    for name, array in tensors:
        spec, raw = encode_tensor(name, array, binary=True)
        specs.append(spec)
        blobs.append(raw)
    header = json.dumps({"inputs": specs, "parameters": {"binary_data_output": True}}).encode()
    return b"".join([header, *blobs]), len(header)


def decode_response(body: bytes, length: str | None, where: str) -> dict[str, np.ndarray]:
    """The outputs of an inference answer (binary tensors after the JSON header, or JSON
    `data`); `length` is its HEADER_LENGTH header."""
    try:
        size = header_length(length)
        size = len(body) if size is None else size
        header = json.loads(body[:size])
        blob, offset, outputs = memoryview(body)[size:], 0, {}
        for spec in header["outputs"]:
            array, used = decode_tensor(spec, blob[offset:], "output")
            outputs[spec["name"]] = array
            offset += used
    except (ProtocolError, ValueError, KeyError, TypeError) as exc:
        raise KilnError(f"{where}: answered with a malformed inference response ({exc}).") from None
    return outputs


def _error(answer: bytes) -> str:
    try:
        return str(json.loads(answer)["error"])
    except (ValueError, KeyError, TypeError):
        return answer[:200].decode("utf-8", "replace") or "no message"
