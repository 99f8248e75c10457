"""`kiln serve`: models over HTTP and gRPC (KServe v2), dynamic batching, a model repository,
/metrics."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from kiln.cli.console import JsonOpt, err
from kiln.cli.flags import Flag, command, options
from kiln.serve.config import ServeConfig

SERVE_FLAGS = options(
    ServeConfig,
    flags={"models": Flag(argument=True, type=list[str], default=[], parse=tuple, metavar="MODEL"),
           "model_repository": Flag(type=Path | None, parse=str)},
)  # fmt: skip


@command
def serve(config: Any = SERVE_FLAGS, json_: JsonOpt = False) -> None:
    """Serve models over HTTP and gRPC: KServe v2 / Open Inference Protocol, dynamic batching,
    /metrics.

    Each model has its own session, buckets and batcher, shared by both protocols.
    --model-repository DIR serves a Triton-layout repository (each model's highest version)
    with load and unload while serving. --grpc-port -1 serves HTTP only.

    Once serving it prints where. With --json that is one JSON line on stdout with the keys
    url, host, port, grpc_port (null without gRPC) and model (models when several are
    served). Ctrl-C or SIGTERM answers every queued request first.
    """
    from kiln.serve.serving import run

    def announce(serving: Any) -> None:
        if json_:
            _ready_line(serving)
        else:
            for text in _serving_lines(serving):
                _say(text)

    run(config, on_ready=announce, say=_say)
    err.print("stopped; every queued request was answered.", highlight=False)


def _say(message: str) -> None:
    err.print(message, highlight=False, markup=False, soft_wrap=True)


def _ready_line(serving: Any) -> None:
    """`--json`'s line once serving: one model as before ({"url", "host", "port", "grpc_port",
    "model"}), several with the repository index's lines (... "models"). grpc_port is the gRPC
    service's port, null without one."""
    where = {"host": serving.host, "port": serving.port, "grpc_port": serving.grpc_port}
    if serving.one is not None:
        line = {"url": f"{serving.url}/v2/models/{serving.one}", **where, "model": serving.one}
    else:
        line = {"url": serving.url, **where, "models": serving.index}
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()  # a pipe is block-buffered: the reader waits on this line


def _serving_lines(serving: Any) -> list[str]:
    """What a person reads once the server accepts requests: a line per model, and gRPC's."""
    from kiln.runtime.buckets import format_buckets

    models, index, base, host = serving.models, serving.index, serving.url, serving.host
    grpc_port = serving.grpc_port

    served = {m.name: m for m in models.served()}
    lines = []
    for row in index:
        model = served.get(row["name"])
        if model is None:
            lines.append(f"'{row['name']}' is {row['state']}: {row['reason']}")
            continue
        batcher, sizes = model.batcher, getattr(model.session, "buckets", None)  # a pipeline: none
        parts = [p.name for p in getattr(model.session, "parts", [])]  # a partitioned artifact
        lines.append(
            f"serving '{model.name}' (version {model.version}) on {base}/v2/models/{model.name}, "
            + batching_text(batcher.max_batch, batcher.max_delay * 1000)
            + (f", buckets {format_buckets(sizes)}" if sizes else "")
            + (f", parts {', '.join(parts)}" if parts else "")
        )
    if grpc_port is not None:
        where = f"[{host}]:{grpc_port}" if ":" in host else f"{host}:{grpc_port}"
        lines.append(f"gRPC (KServe v2 GRPCInferenceService) on {where}")
    extra = ", model control at /v2/repository" if models.repository is not None else ""
    return [*lines, f"(Ctrl-C to stop{extra})"]


def batching_text(max_batch: int, max_delay_ms: float) -> str:
    """The batcher's settings for the 'serving' line."""
    if max_delay_ms == 0:
        return f"batches of up to {max_batch} from the requests already waiting"
    return f"batches of up to {max_batch} within {max_delay_ms:g} ms"
