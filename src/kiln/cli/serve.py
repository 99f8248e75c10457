"""`kiln serve`: models over HTTP and gRPC (KServe v2), dynamic batching, a model repository,
/metrics."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer

from kiln.cli.console import JsonOpt, err
from kiln.errors import KilnError

GRPC_PORT = 8001  # Triton's, beside its HTTP 8000


def model_name(model: str) -> str:
    """The served name: zoo:NAME → NAME; path/NAME.kiln or path/NAME.onnx → NAME."""
    if model.startswith("zoo:"):
        return model[len("zoo:") :]
    return Path(model.rstrip("/")).stem


def _named(model: str) -> tuple[str | None, str]:
    """`NAME=MODEL` → (NAME, MODEL): a model served under a name of its own (two splits'
    server.kiln side by side); anything else (a path that exists, zoo:NAME) → (None, model)."""
    name, equals, source = model.partition("=")
    if not equals or not name or "/" in name or name.startswith("zoo:") or Path(model).exists():
        return None, model
    return name, source


ModelsArg = Annotated[
    list[str] | None,
    typer.Argument(
        help="NAME.kiln artifacts, .onnx files or zoo:NAME; each served under its name (the "
        "file's stem), or under NAME given as NAME=MODEL.",
        metavar="MODEL",
        show_default=False,
    ),
]


def serve(
    models: ModelsArg = None,
    model_repository: Annotated[
        Path | None,
        typer.Option(
            "--model-repository",
            help="Serve a Triton-layout repository, DIR/NAME/VERSION/ holding an artifact or a "
            "model.onnx (the highest VERSION), with load and unload while serving.",
        ),
    ] = None,
    port: Annotated[int, typer.Option(help="TCP port to listen on; 0: any free port.")] = 8000,
    grpc_port: Annotated[
        int | None,
        typer.Option(
            help=f"Port of the KServe v2 gRPC service (what tritonclient.grpc calls). Default "
            f"{GRPC_PORT}, as Triton, or any free port when --port is 0; 0: any free port; "
            "-1: no gRPC.",
            show_default=False,
        ),
    ] = None,
    host: Annotated[str, typer.Option(help="Address to bind; 0.0.0.0 for every interface.")] = (
        "127.0.0.1"
    ),
    name: Annotated[
        str | None,
        typer.Option(help="Model name in URLs, for one model (default: the file's stem)."),
    ] = None,
    buckets: Annotated[
        str | None,
        typer.Option(
            help='Shape buckets per dynamic dim, e.g. "batch=1,4,8 seq=32,64" (one model).'
        ),
    ] = None,
    max_batch: Annotated[
        int | None,
        typer.Option(
            help="Most samples batched together, and the most one request may bring: a "
            "bigger request is refused (400). A config.pbtxt's max_batch_size takes its place. "
            "Default: what kiln tune --clients picked for this artifact, else 16."
        ),
    ] = None,
    max_delay_ms: Annotated[
        float | None,
        typer.Option(
            help="Longest a request waits for others to batch with (ms). Default: what kiln "
            "tune --clients picked for this artifact, else 0: batches form from the requests "
            "already waiting, and a lone request runs at once."
        ),
    ] = None,
    max_queue: Annotated[
        int,
        typer.Option(
            help="Requests allowed to wait; beyond this the server answers 503 (gRPC: UNAVAILABLE)."
        ),
    ] = 256,
    max_request_mb: Annotated[
        float,
        typer.Option(
            help="Largest request body or gRPC message (MiB); beyond this the answer is 413 "
            "(gRPC: RESOURCE_EXHAUSTED)."
        ),
    ] = 64.0,
    warmup: Annotated[bool, typer.Option(help="Compile every bucket before serving.")] = False,
    adaptive: Annotated[
        bool, typer.Option(help="Learn buckets from traffic; recompile and swap in background.")
    ] = False,
    feedback: Annotated[
        bool,
        typer.Option(
            help="Tune from live traffic (one model): windows of latency, batch sizes, padding, "
            "queue and CPU feed a loop that proposes strategies, A/B-measures each on replayed "
            "requests and hot-swaps it in only when it is --min-gain better (kiln strategies "
            "list)."
        ),
    ] = False,
    feedback_objective: Annotated[
        str | None,
        typer.Option(
            help="With --feedback: what the loop improves, latency (default) or throughput."
        ),  # fmt: skip
    ] = None,
    feedback_interval: Annotated[
        float | None,
        typer.Option(help="With --feedback: seconds per traffic window (default 60)."),
    ] = None,
    min_gain: Annotated[
        float | None,
        typer.Option(
            help="With --feedback: the improvement a strategy must show to be "
            "adopted (default 0.10: 10 %)."
        ),  # fmt: skip
    ] = None,
    storage: Annotated[
        str | None,
        typer.Option(help="Strategy-library database for --feedback (default: under KILN_HOME)."),
    ] = None,
    json_: JsonOpt = False,
) -> None:
    """Serve models over HTTP and gRPC: KServe v2 / Open Inference Protocol, dynamic batching,
    /metrics.

    Each model has its own session, buckets and batcher, shared by both protocols.
    --model-repository DIR serves a Triton-layout repository (each model's highest version)
    with load and unload while serving. --grpc-port -1 serves HTTP only.

    Once serving it prints where. With --json that is one JSON line on stdout with the keys
    url, host, port, grpc_port (null without gRPC) and model (models when several are
    served). Ctrl-C or SIGTERM answers every queued request first.
    """
    import signal

    from kiln.serve.repository import Repository
    from kiln.serve.server import bind, http_server, url

    sources = _check_models(models or [], model_repository, name, buckets, feedback)
    _check_settings(max_batch, max_delay_ms, max_queue, max_request_mb)
    grpc_port = _grpc_port(grpc_port, port)
    max_request_bytes = int(max_request_mb * 2**20)
    loop_flags = {"--feedback-objective": feedback_objective, "--min-gain": min_gain,
                  "--feedback-interval": feedback_interval, "--storage": storage}  # fmt: skip
    given = [flag for flag, value in loop_flags.items() if value is not None]
    if given and not feedback:  # silently ignored, they would mislead
        raise KilnError(f"{given[0]} sets the feedback loop: add --feedback, or drop it.")
    feedback_objective = feedback_objective or "latency"
    feedback_interval = 60.0 if feedback_interval is None else feedback_interval
    min_gain = 0.10 if min_gain is None else min_gain
    if feedback and (feedback_interval <= 0 or not 0 <= min_gain < 10):
        raise KilnError("--feedback-interval must be > 0 and --min-gain in [0, 10).")
    if feedback_objective not in ("latency", "throughput"):
        raise KilnError(f"--feedback-objective {feedback_objective}: use latency or throughput.")
    # A missing repository is one line before anything else, as a bad port is.
    repository = Repository(model_repository, _say) if model_repository else None
    # Bound before the models load: a bad --port, --grpc-port or --host is one line at once,
    # and port 0 knows its port. Closed on any error (load failures included).
    sock = bind(host, port)
    with sock, _serving_grpc(host, grpc_port, max_request_bytes) as grpc_server:
        from kiln.backends import share_process
        from kiln.runtime import Session  # seconds of engine imports: after the quick checks
        from kiln.serve.app import create_models_app
        from kiln.serve.models import BatchSettings, ModelSet

        share_process()  # the event loop and batchers share the cores: no pool spins idle

        def settings(source: str) -> BatchSettings:
            batch, delay = batcher_settings(source, max_batch, max_delay_ms)
            return BatchSettings(batch, delay, max_queue)

        def open_session(source: str, backend: str | None = None) -> Session:
            return Session(source, buckets=buckets, warmup=warmup, adaptive=adaptive,
                           keep_requests=256 if feedback else 0, backend=backend)  # fmt: skip

        served = ModelSet(open_session, settings, repository)
        if repository is not None:
            index = served.load_repository()
        else:  # every file must open: a bad one is one line and exit 2, as with one model
            for served_as, model in sources.items():
                served.open(served_as, model)
            index = served.index()
        app = create_models_app(
            served,
            max_request_bytes=max_request_bytes,
            before_close=grpc_server.stop if grpc_server is not None else None,
        )
        if grpc_server is not None:  # the same models, batchers and metrics as HTTP
            grpc_server.start(served)
        loop = None
        if feedback:
            from kiln.tune.feedback import FeedbackLoop
            from kiln.tune.storage import default_url

            (only,) = served.served()
            loop = FeedbackLoop(
                only.session, objective=feedback_objective, min_gain=min_gain,
                interval_s=feedback_interval, library_url=storage or default_url(),
                queue_depth=lambda: only.depth, model=only.name, say=_say,
            ).start()  # fmt: skip
        base = url(host, sock.getsockname()[1])
        one = None if repository is not None or len(sources) > 1 else index[0]["name"]
        grpc_bound = grpc_server.port if grpc_server is not None else None

        def announce() -> None:
            if json_:
                _ready_line(base, host, sock.getsockname()[1], grpc_bound, one, index)
            else:
                for text in _serving_lines(served, index, base, host, grpc_bound):
                    _say(text)

        # uvicorn shuts down gracefully on SIGINT/SIGTERM (requests in flight and queued are
        # answered), then re-raises the signal under the handlers found at start. These no-op
        # handlers make that a normal exit (status 0) instead of a kill or a KeyboardInterrupt.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
        try:
            http_server(app, on_ready=announce).run(sockets=[sock])
        finally:
            if loop is not None:
                loop.stop()
    err.print("stopped; every queued request was answered.", highlight=False)


def _say(message: str) -> None:
    err.print(message, highlight=False, markup=False, soft_wrap=True)


def _ready_line(
    base: str, host: str, port: int, grpc_port: int | None, one: str | None, index: list[dict]
) -> None:
    """`--json`'s line once serving: one model as before ({"url", "host", "port", "grpc_port",
    "model"}), several with the repository index's lines (... "models"). grpc_port is the gRPC
    service's port, null without one."""
    where = {"host": host, "port": port, "grpc_port": grpc_port}
    if one is not None:
        line = {"url": f"{base}/v2/models/{one}", **where, "model": one}
    else:
        line = {"url": base, **where, "models": index}
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()  # a pipe is block-buffered: the reader waits on this line


def _check_models(
    models: list[str], repository: Path | None, name: str | None, buckets: str | None,
    feedback: bool,
) -> dict[str, str]:  # fmt: skip
    """The name each model given is served as → the model; KilnError, naming the flag, for
    what cannot go together."""
    if bool(models) == (repository is not None):
        raise KilnError(
            "give the models to serve (NAME.kiln, .onnx files, zoo:NAME) or "
            "--model-repository DIR, one or the other."
        )
    several = repository is not None or len(models) > 1
    for flag, value in [("--name", name), ("--buckets", buckets), ("--feedback", feedback)]:
        if several and value:
            raise KilnError(
                f"{flag} applies to one model; with several, each is served under its file's "
                "stem (or NAME, given as NAME=MODEL), with the buckets and batcher its "
                "artifact records."
            )
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


def _grpc_port(grpc_port: int | None, http_port: int) -> int | None:
    """The gRPC port to bind, None for none: Triton's 8001 unless told, or any free port
    beside an HTTP --port 0 (tests and scripts that take what they get, several at a time)."""
    if grpc_port is None:
        return 0 if http_port == 0 else GRPC_PORT
    if grpc_port == -1:
        return None
    if not 0 <= grpc_port <= 65535:
        raise KilnError(
            f"--grpc-port {grpc_port}: use a port from 1 to 65535, 0 for any free port, or -1 "
            "for no gRPC."
        )
    if grpc_port == http_port != 0:
        raise KilnError(f"--grpc-port {grpc_port} is --port too: give gRPC another port.")
    return grpc_port


@contextmanager
def _serving_grpc(host: str, port: int | None, max_request_bytes: int) -> Iterator[Any]:
    """The gRPC server, bound (a bad port is one line now, before any model loads) and
    stopped on the way out whatever happens; None when there is to be none."""
    if port is None:
        yield None
        return
    from kiln.serve.grpc_service import GrpcServer

    server = GrpcServer(host, port, max_request_bytes=max_request_bytes)
    try:
        yield server
    finally:
        server.stop()


def _check_settings(
    max_batch: int | None, max_delay_ms: float | None, max_queue: int, max_request_mb: float
) -> None:
    for flag, value in [("--max-batch", max_batch), ("--max-queue", max_queue)]:
        if value is not None and value < 1:
            raise KilnError(f"{flag} must be at least 1, got {value}.")
    if (max_delay_ms is not None and max_delay_ms < 0) or max_request_mb <= 0:
        raise KilnError("--max-delay-ms must be ≥ 0 and --max-request-mb > 0.")


def _serving_lines(
    models: Any, index: list[dict[str, str]], base: str, host: str, grpc_port: int | None
) -> list[str]:
    """What a person reads once the server accepts requests: a line per model, and gRPC's."""
    from kiln.runtime.buckets import format_buckets

    served = {m.name: m for m in models.served()}
    lines = []
    for row in index:
        model = served.get(row["name"])
        if model is None:
            lines.append(f"'{row['name']}' is {row['state']}: {row['reason']}")
            continue
        batcher, sizes = model.batcher, model.session.buckets
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


def batcher_settings(
    model: str, max_batch: int | None, max_delay_ms: float | None
) -> tuple[int, float]:
    """The flags where given; else what `kiln tune --clients` measured best for this artifact
    (its manifest's tune → serving); else 16 samples and no delay, as Triton's dynamic batcher
    by default: a lone request is not held back for company that may never come."""
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


def batching_text(max_batch: int, max_delay_ms: float) -> str:
    """The batcher's settings for the 'serving' line."""
    if max_delay_ms == 0:
        return f"batches of up to {max_batch} from the requests already waiting"
    return f"batches of up to {max_batch} within {max_delay_ms:g} ms"
