"""Per-node latency for `kiln split`'s cut search: this machine's (from the engine's profile of
the compiled whole model), an edge device's (from the JSON `kiln profile --json` wrote there),
and the fixed cost of one request on the network path.

Kernel times are mapped to the original nodes through the compiled nodes' `kiln.origin`; a
kernel the engine inserted (a layout reorder) counts for the next kernel that names a node,
which reads what it produced. The per-node figures are then scaled so that they sum to the
whole model's measured latency without the profiler (which slows every kernel a little).
"""

from __future__ import annotations

import http.client
import http.server
import json
import socket
import statistics
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from kiln.backends import KernelRecord, get_backend
from kiln.errors import KilnError
from kiln.ir.provenance import ORIGIN_KEY, split_origins
from kiln.timing import median_ms

Feeds = dict[str, np.ndarray]
_MIN_NAME = 3  # shorter names match kernel names by accident
MIN_COVERAGE = 0.5  # an edge profile naming fewer of the model's nodes is of another model


def node_times(
    compiled: ir.Model, executable: Any, feeds: Feeds, runs: int = 20
) -> tuple[dict[str, float], float]:
    """Original node name → ms per run on this machine, and the whole model's median
    latency (ms) they sum to."""
    # The median of three blocks' medians: one block on a shared host can sit in a slow
    # second (resnet50 on 2 cores: blocks of 20 runs read 52–68 ms in a row).
    latency = statistics.median(median_ms(lambda: executable.run(feeds), runs) for _ in range(3))
    profile = executable.profile(feeds, max(3, runs // 2))
    raw = kernel_times(profile.records, compiled)
    return _scaled(raw, latency), latency


def kernel_times(records: list[KernelRecord], compiled: ir.Model) -> dict[str, float]:
    """Original node → mean ms per profiled run, from the engine's kernel records."""
    runs = max(len({r.run for r in records}), 1)
    owners = _Owners(compiled)
    ordered = sorted(records, key=lambda r: (r.run, r.ts_us or 0.0))
    times: dict[str, float] = defaultdict(float)
    pending = 0.0  # engine-made kernels wait for the next kernel that names a node
    for record in ordered:
        origins = owners.origins(record)
        if not origins:
            pending += record.dur_us
            continue
        share = (record.dur_us + pending) / 1e3 / runs / len(origins)
        pending = 0.0
        for origin in origins:
            times[origin] += share
    return dict(times)


class _Owners:
    """Engine kernel → the compiled node it ran (its own name, the tensor it computes, or
    the longest of either inside the kernel's name: ONNX Runtime's `relu_nchwc`) → origins."""

    def __init__(self, model: ir.Model) -> None:
        self.by_name: dict[str, ir.Node] = {}
        for node in model.graph:
            if node.name:
                self.by_name[node.name] = node
            for value in node.outputs:
                if value.name:
                    self.by_name.setdefault(value.name, node)
        self.longest = sorted((n for n in self.by_name if len(n) >= _MIN_NAME), key=len)[::-1]
        self._cache: dict[str, list[str]] = {}

    def origins(self, record: KernelRecord) -> list[str]:
        if record.node not in self._cache:
            self._cache[record.node] = self._origins(record)
        return self._cache[record.node]

    def _origins(self, record: KernelRecord) -> list[str]:
        if record.origin:  # OpenVINO names the layers it fused itself
            nodes = [self.by_name[n] for n in record.origin if n in self.by_name]
        else:
            name = record.node if record.node in self.by_name else None
            name = name or next((n for n in self.longest if n in record.node), None)
            nodes = [self.by_name[name]] if name else []
        found: set[str] = set()
        for node in nodes:
            found |= split_origins(node.metadata_props.get(ORIGIN_KEY, "")) or {node.name or ""}
        return sorted(found - {""})


def edge_node_times(path: Path, model: ir.Model) -> tuple[dict[str, float], float]:
    """Original node → ms from `kiln profile --json` run on the edge (of the original model
    or of an artifact built from it), scaled to the P50 it measured; and that P50."""
    try:
        data = json.loads(Path(path).read_text())
        kernels = data["nodes"]
        latency = float(data["latency"]["p50_ms"])
        times: dict[str, float] = defaultdict(float)
        for kernel in kernels:
            origins = kernel.get("original") or kernel.get("graph_nodes") or []
            for origin in origins:
                times[str(origin)] += float(kernel["median_ms"]) / len(origins)
    except OSError as exc:
        raise KilnError(f"--edge-profile {path}: cannot read it ({exc.strerror or exc}).") from None
    except (ValueError, KeyError, TypeError, ZeroDivisionError):
        raise KilnError(
            f"--edge-profile {path}: not the JSON `kiln profile MODEL --json` writes; run that "
            "on the edge device and give its output."
        ) from None
    names = {n.name for n in model.graph if n.name}
    covered = len(names & set(times)) / max(len(names), 1)
    if covered < MIN_COVERAGE:
        raise KilnError(
            f"--edge-profile {path}: names {covered:.0%} of the model's nodes; it profiles "
            f"another model ({data.get('source', '?')}). Profile this model on the edge."
        )
    return _scaled(dict(times), latency), latency


def _scaled(times: dict[str, float], total_ms: float) -> dict[str, float]:
    measured = sum(times.values())
    if measured <= 0:
        return times
    return {name: ms * total_ms / measured for name, ms in times.items()}


def whole_model_times(
    compiled: ir.Model, engine: str, options: Any, feeds: Feeds, runs: int
) -> tuple[dict[str, float], float]:
    """`node_times` of a compiled model on its engine."""
    executable = get_backend(engine).compile(compiled, options)
    return node_times(compiled, executable, feeds, runs)


_OVERHEAD: list[float] = []  # measured once per process


def loopback_overhead_ms(requests: int = 30) -> float:
    """The median round trip of a null HTTP request on loopback (a request's fixed cost on
    the network path, beside the bytes); measured once per process."""
    if _OVERHEAD:
        return _OVERHEAD[0]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NullHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        connection = http.client.HTTPConnection("127.0.0.1", server.server_port, timeout=5)
        connection.connect()
        connection.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _OVERHEAD.append(median_ms(lambda: _post(connection), requests))
        connection.close()
    finally:
        server.shutdown()
        server.server_close()
    return _OVERHEAD[0]


def _post(connection: http.client.HTTPConnection) -> None:
    connection.request("POST", "/", body=b"{}", headers={"Content-Type": "application/json"})
    connection.getresponse().read()


class _NullHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the remote session's connection
    # Headers and body go out as two writes: with Nagle's algorithm on, the second waits for
    # the client's delayed ACK (40 ms), which no real server makes a request pay.
    disable_nagle_algorithm = True

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *_args: object) -> None:  # quiet
        return
