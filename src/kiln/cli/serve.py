"""`kiln serve`: a model over HTTP (KServe v2), dynamic batching, /metrics."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from kiln.cli.console import JsonOpt, err
from kiln.errors import KilnError


def model_name(model: str) -> str:
    """The served name: zoo:NAME → NAME; path/NAME.kiln or path/NAME.onnx → NAME."""
    if model.startswith("zoo:"):
        return model[len("zoo:") :]
    return Path(model.rstrip("/")).stem


def serve(
    model: Annotated[str, typer.Argument(help="A NAME.kiln artifact, an .onnx file, or zoo:NAME.")],
    port: Annotated[int, typer.Option(help="TCP port to listen on; 0: any free port.")] = 8000,
    host: Annotated[str, typer.Option(help="Address to bind; 0.0.0.0 for every interface.")] = (
        "127.0.0.1"
    ),
    name: Annotated[
        str | None, typer.Option(help="Model name in URLs (default: the model file's stem).")
    ] = None,
    buckets: Annotated[
        str | None,
        typer.Option(help='Shape buckets per dynamic dim, e.g. "batch=1,4,8 seq=32,64".'),
    ] = None,
    max_batch: Annotated[
        int | None,
        typer.Option(
            help="Most samples batched together (a bigger request runs alone). Default: what "
            "kiln tune --clients picked for this artifact, else 16."
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
        int, typer.Option(help="Requests allowed to wait; beyond this the server answers 503.")
    ] = 256,
    max_request_mb: Annotated[
        float, typer.Option(help="Largest request body (MiB); beyond this the answer is 413.")
    ] = 64.0,
    warmup: Annotated[bool, typer.Option(help="Compile every bucket before serving.")] = False,
    adaptive: Annotated[
        bool, typer.Option(help="Learn buckets from traffic; recompile and swap in background.")
    ] = False,
    feedback: Annotated[
        bool,
        typer.Option(
            help="Tune from live traffic: windows of latency, batch sizes, padding, queue and "
            "CPU feed a loop that proposes strategies, A/B-measures each on replayed requests "
            "and hot-swaps it in only when it is --min-gain better (kiln strategies list)."
        ),
    ] = False,
    feedback_objective: Annotated[
        str | None,
        typer.Option(help="With --feedback: what the loop improves, latency (default) or "
                     "throughput."),  # fmt: skip
    ] = None,
    feedback_interval: Annotated[
        float | None,
        typer.Option(help="With --feedback: seconds per traffic window (default 60)."),
    ] = None,
    min_gain: Annotated[
        float | None,
        typer.Option(help="With --feedback: the improvement a strategy must show to be "
                     "adopted (default 0.10: 10 %)."),  # fmt: skip
    ] = None,
    storage: Annotated[
        str | None,
        typer.Option(help="Strategy-library database for --feedback (default: under KILN_HOME)."),
    ] = None,
    json_: JsonOpt = False,
) -> None:
    """Serve a model over HTTP: KServe v2 / Open Inference Protocol, dynamic batching, /metrics.

    Once it accepts requests it prints where (with --json: one line {"url", "host", "port",
    "model"} on stdout). Ctrl-C or SIGTERM answers every queued request before exiting.
    """
    import signal

    from kiln.serve.server import bind, http_server, url

    max_batch, max_delay_ms = batcher_settings(model, max_batch, max_delay_ms)
    for flag, value in [("--max-batch", max_batch), ("--max-queue", max_queue)]:
        if value < 1:
            raise KilnError(f"{flag} must be at least 1, got {value}.")
    if max_delay_ms < 0 or max_request_mb <= 0:
        raise KilnError("--max-delay-ms must be ≥ 0 and --max-request-mb > 0.")
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
    served = name or model_name(model)
    # Bound before the model loads: a bad --port or --host is one line at once, and --port 0
    # knows its port. Closed on any error (load failures included).
    sock = bind(host, port)
    with sock:
        from kiln.runtime import Session  # seconds of engine imports: after the quick checks
        from kiln.runtime.buckets import format_buckets
        from kiln.serve.app import create_app

        session = Session(model, buckets=buckets, warmup=warmup, adaptive=adaptive,
                          keep_requests=256 if feedback else 0)  # fmt: skip
        app = create_app(
            session,
            served,
            max_batch=max_batch,
            max_delay_ms=max_delay_ms,
            max_queue=max_queue,
            max_request_bytes=int(max_request_mb * 2**20),
        )
        loop = None
        if feedback:
            from kiln.tune.feedback import FeedbackLoop
            from kiln.tune.storage import default_url

            batcher = app.state.batcher
            loop = FeedbackLoop(
                session, objective=feedback_objective, min_gain=min_gain,
                interval_s=feedback_interval, library_url=storage or default_url(),
                queue_depth=lambda: batcher.depth, model=served,
                say=lambda msg: err.print(msg, highlight=False, markup=False, soft_wrap=True),
            ).start()  # fmt: skip
        where = f"{url(host, sock.getsockname()[1])}/v2/models/{served}"

        def announce() -> None:
            if json_:
                line = {"url": where, "host": host, "port": sock.getsockname()[1], "model": served}
                sys.stdout.write(json.dumps(line) + "\n")
                sys.stdout.flush()  # a pipe is block-buffered: the reader waits on this line
            else:
                sizes = session.buckets
                err.print(
                    f"serving '{served}' on {where}, {batching_text(max_batch, max_delay_ms)}"
                    + (f", buckets {format_buckets(sizes)}" if sizes else "")
                    + " (Ctrl-C to stop)",
                    highlight=False,
                    markup=False,
                    soft_wrap=True,
                )

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
