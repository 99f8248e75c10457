"""`run(config)`: a `ServeConfig` served until SIGINT or SIGTERM — what `kiln serve` calls.

The socket and the gRPC port are bound first (a bad port or host is one line before any model
loads), then the models are opened, the app and the feedback loop started, and uvicorn runs
until a signal; every queued request is answered before `run` returns.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.errors import KilnError
from kiln.serve.config import ServeConfig
from kiln.serve.server import bind, http_server, url


@dataclass(frozen=True)
class Serving:
    """Where the server listens once it accepts requests, for the caller to announce."""

    url: str  # http://host:port
    host: str
    port: int
    grpc_port: int | None  # None: no gRPC
    one: str | None  # the one model's name; None for several or a repository
    index: list[dict]  # the repository index: each model's name, version, state, reason
    models: Any  # the ModelSet


def run(
    config: ServeConfig,
    on_ready: Callable[[Serving], None] = lambda _serving: None,
    say: Callable[[str], None] = print,
) -> None:
    """Serve `config`'s models until SIGINT or SIGTERM, answering every queued request
    before returning. A bad port, host or repository is a KilnError before any model loads;
    so is a model that cannot be opened. `on_ready` is called once requests are accepted."""
    from kiln.serve.repository import Repository

    sources = served_names(config.models, config.name)
    repository = Repository(config.model_repository, say) if config.model_repository else None
    # Bound before the models load: a bad --port, --grpc-port or --host is one line at once,
    # and port 0 knows its port. Closed on any error (load failures included).
    sock = bind(config.host, config.port)
    with sock, _serving_grpc(config) as grpc_server:
        from kiln.backends import share_process
        from kiln.serve.app import create_models_app

        share_process()  # the event loop and batchers share the cores: no pool spins idle
        served = _model_set(config, repository)
        if repository is not None:
            index = served.load_repository()
        else:  # every file must open: a bad one is one line and exit 2, as with one model
            for served_as, model in sources.items():
                served.open(served_as, model)
            index = served.index()
        app = create_models_app(
            served,
            max_request_bytes=config.max_request_bytes,
            before_close=grpc_server.stop if grpc_server is not None else None,
        )
        if grpc_server is not None:  # the same models, batchers and metrics as HTTP
            grpc_server.start(served)
        loop = _feedback_loop(config, served, say) if config.feedback else None
        port = sock.getsockname()[1]
        one = None if repository is not None or len(sources) > 1 else index[0]["name"]
        grpc_bound = grpc_server.port if grpc_server is not None else None
        ready = Serving(url(config.host, port), config.host, port, grpc_bound, one, index, served)
        # uvicorn shuts down gracefully on SIGINT/SIGTERM (requests in flight and queued are
        # answered), then re-raises the signal under the handlers found at start. These no-op
        # handlers make that a normal exit instead of a kill or a KeyboardInterrupt.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        try:
            http_server(app, on_ready=lambda: on_ready(ready)).run(sockets=[sock])
        finally:
            if loop is not None:
                loop.stop()


def _model_set(config: ServeConfig, repository: Any) -> Any:
    """The models served, each opened as a kiln.Session with its batcher's settings."""
    from kiln.pipeline.pipeline_artifact import is_pipeline
    from kiln.pipeline.served import PipelineSession
    from kiln.runtime import Session  # seconds of engine imports: after the quick checks
    from kiln.serve.models import BatchSettings, ModelSet

    def settings(source: str) -> BatchSettings:
        batch, delay = batcher_settings(source, config.max_batch, config.max_delay_ms)
        return BatchSettings(batch, delay, config.max_queue)

    def open_session(source: str, backend: str | None = None) -> Any:
        if is_pipeline(source):  # one model: bytes in, each query's result as JSON out
            return PipelineSession(source)
        return Session(source, buckets=config.buckets, warmup=config.warmup,
                       adaptive=config.adaptive, keep_requests=256 if config.feedback else 0,
                       backend=backend)  # fmt: skip

    return ModelSet(open_session, settings, repository)


def _feedback_loop(config: ServeConfig, served: Any, say: Callable[[str], None]) -> Any:
    """The loop tuning the one model served from its live traffic, started."""
    from kiln.tune.feedback import FeedbackLoop
    from kiln.tune.storage import default_url

    (only,) = served.served()
    return FeedbackLoop(
        only.session, objective=config.feedback_objective, min_gain=config.min_gain,
        interval_s=config.feedback_interval, library_url=config.storage or default_url(),
        queue_depth=lambda: only.depth, model=only.name, say=say,
    ).start()  # fmt: skip


@contextmanager
def _serving_grpc(config: ServeConfig) -> Iterator[Any]:
    """The gRPC server, bound (a bad port is one line now, before any model loads) and
    stopped on the way out whatever happens; None when there is to be none."""
    port = config.grpc_bind_port()
    if port is None:
        yield None
        return
    from kiln.serve.grpc_service import GrpcServer

    server = GrpcServer(config.host, port, max_request_bytes=config.max_request_bytes)
    try:
        yield server
    finally:
        server.stop()


def model_name(model: str) -> str:
    """The served name: zoo:NAME → NAME; path/NAME.kiln or path/NAME.onnx → NAME."""
    if model.startswith("zoo:"):
        return model[len("zoo:") :]
    return Path(model.rstrip("/")).stem


def served_names(models: Sequence[str], name: str | None = None) -> dict[str, str]:
    """The name each model given is served as → the model: NAME=MODEL, else `name` (one
    model), else the file's stem; KilnError when two would share a name."""
    names: dict[str, str] = {}
    for given in models:
        own, model = _named(given)
        served = own or name or model_name(model)
        if served in names:
            raise KilnError(
                f"{names[served]} and {model} would both be served as '{served}'; serve one "
                f"under another name: NAME={model}."
            )
        names[served] = model
    return names


def _named(model: str) -> tuple[str | None, str]:
    """`NAME=MODEL` → (NAME, MODEL): a model served under a name of its own (two splits'
    server.kiln side by side); anything else (a path that exists, zoo:NAME) → (None, model)."""
    name, equals, source = model.partition("=")
    if not equals or not name or "/" in name or name.startswith("zoo:") or Path(model).exists():
        return None, model
    return name, source


def batcher_settings(
    model: str, max_batch: int | None, max_delay_ms: float | None
) -> tuple[int, float]:
    """The settings where given; else what `kiln tune --clients` measured best for this
    artifact (its manifest's tune → serving); else 16 samples and no delay, as Triton's
    dynamic batcher by default: a lone request is not held back for company that may never
    come."""
    tuned: dict = {}
    if (max_batch is None or max_delay_ms is None) and Path(model, "manifest.json").is_file():
        from kiln.artifact import read_artifact

        try:
            benchmark = read_artifact(model).manifest.benchmark or {}
            tuned = (benchmark.get("tune") or {}).get("serving") or {}
        except KilnError:
            tuned = {}  # the load that follows names what is wrong with it
    batch = max_batch if max_batch is not None else int(tuned.get("max_batch", 16))
    delay = max_delay_ms if max_delay_ms is not None else float(tuned.get("max_delay_ms", 0.0))
    return batch, delay
