"""`ServeConfig`: every setting of one server, as data — what `kiln.serve.server.run` takes
and what `kiln serve`'s flags are generated from, so the two cannot disagree on a default.

The feedback loop's defaults are `kiln.tune.feedback.FeedbackLoop`'s own (a test holds them
equal); they are written here rather than read from it so that `kiln --help` does not import
the tuner.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kiln.errors import KilnError

GRPC_PORT = 8001  # Triton's, beside its HTTP 8000
OBJECTIVES = ("latency", "throughput")


@dataclass(frozen=True)
class ServeConfig:
    """How models are served over HTTP and gRPC (KServe v2)."""

    models: tuple[str, ...] = ()
    """NAME.kiln artifacts, .onnx files or zoo:NAME; each served under its name (the file's
    stem), or under NAME given as NAME=MODEL."""
    model_repository: str | None = None
    """Serve a Triton-layout repository, DIR/NAME/VERSION/ holding an artifact or a model.onnx
    (the highest VERSION), with load and unload while serving."""
    port: int = 8000
    """TCP port to listen on; 0: any free port."""
    grpc_port: int | None = None
    """Port of the KServe v2 gRPC service (what tritonclient.grpc calls). Default 8001, as
    Triton, or any free port when port is 0; 0: any free port; -1: no gRPC."""
    host: str = "127.0.0.1"
    """Address to bind; 0.0.0.0 for every interface."""
    name: str | None = None
    """Model name in URLs, for one model (default: the file's stem)."""
    buckets: str | None = None
    """Shape buckets per dynamic dim, e.g. "batch=1,4,8 seq=32,64" (one model)."""
    max_batch: int | None = None
    """Most samples batched together, and the most one request may bring: a bigger request
    is refused (400). A config.pbtxt's max_batch_size takes its place. Default: what kiln tune
    --clients picked for this artifact, else 16."""
    max_delay_ms: float | None = None
    """Longest a request waits for others to batch with (ms). Default: what kiln tune
    --clients picked for this artifact, else 0: batches form from the requests already
    waiting, and a lone request runs at once."""
    max_queue: int = 256
    """Requests allowed to wait; beyond this the server answers 503 (gRPC: UNAVAILABLE)."""
    max_request_mb: float = 64.0
    """Largest request body or gRPC message (MiB); beyond this the answer is 413 (gRPC:
    RESOURCE_EXHAUSTED)."""
    warmup: bool = False
    """Compile every bucket before serving."""
    adaptive: bool = False
    """Learn buckets from traffic; recompile and swap in background."""
    feedback: bool = False
    """Tune from live traffic (one model): windows of latency, batch sizes, padding, queue and
    CPU feed a loop that proposes strategies, A/B-measures each on replayed requests and
    hot-swaps it in only when it is min-gain better (kiln strategies list)."""
    feedback_objective: str = "latency"
    """With feedback: what the loop improves, latency or throughput."""
    feedback_interval: float = 30.0
    """With feedback: seconds per traffic window."""
    min_gain: float = 0.10
    """With feedback: the improvement a strategy must show to be adopted (0.10: 10 %)."""
    storage: str | None = None
    """Strategy-library database for feedback (default: under KILN_HOME)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", tuple(self.models or ()))
        if bool(self.models) == (self.model_repository is not None):
            raise KilnError(
                "give the models to serve (NAME.kiln, .onnx files, zoo:NAME) or "
                "--model-repository DIR, one or the other."
            )
        several = self.model_repository is not None or len(self.models) > 1
        for flag, value in [("--name", self.name), ("--buckets", self.buckets),
                            ("--feedback", self.feedback)]:  # fmt: skip
            if several and value:
                raise KilnError(
                    f"{flag} applies to one model; with several, each is served under its "
                    "file's stem (or NAME, given as NAME=MODEL), with the buckets and batcher "
                    "its artifact records."
                )
        self._check_batching()
        self.grpc_bind_port()
        self._check_feedback()

    def replace(self, **changes: Any) -> ServeConfig:
        return dataclasses.replace(self, **changes)

    @property
    def max_request_bytes(self) -> int:
        return int(self.max_request_mb * 2**20)

    def grpc_bind_port(self) -> int | None:
        """The gRPC port to bind, None for none: Triton's 8001 unless told, or any free port
        beside an HTTP port 0 (tests and scripts that take what they get, several at a
        time)."""
        if self.grpc_port is None:
            return 0 if self.port == 0 else GRPC_PORT
        if self.grpc_port == -1:
            return None
        if not 0 <= self.grpc_port <= 65535:
            raise KilnError(
                f"--grpc-port {self.grpc_port}: use a port from 1 to 65535, 0 for any free "
                "port, or -1 for no gRPC."
            )
        if self.grpc_port == self.port != 0:
            raise KilnError(f"--grpc-port {self.grpc_port} is --port too: give gRPC another port.")
        return self.grpc_port

    def _check_batching(self) -> None:
        for flag, value in [("--max-batch", self.max_batch), ("--max-queue", self.max_queue)]:
            if value is not None and value < 1:
                raise KilnError(f"{flag} must be at least 1, got {value}.")
        if (self.max_delay_ms is not None and self.max_delay_ms < 0) or self.max_request_mb <= 0:
            raise KilnError("--max-delay-ms must be ≥ 0 and --max-request-mb > 0.")

    def _check_feedback(self) -> None:
        """The loop's settings only with the loop: silently ignored, they would mislead."""
        given = [
            flag
            for flag, name in _LOOP_FLAGS.items()
            if getattr(self, name) != getattr(ServeConfig, name)
        ]  # the class: defaults
        if given and not self.feedback:
            raise KilnError(f"{given[0]} sets the feedback loop: add --feedback, or drop it.")
        if self.feedback and (self.feedback_interval <= 0 or not 0 <= self.min_gain < 10):
            raise KilnError("--feedback-interval must be > 0 and --min-gain in [0, 10).")
        if self.feedback_objective not in OBJECTIVES:
            raise KilnError(
                f"--feedback-objective {self.feedback_objective}: use latency or throughput."
            )


_LOOP_FLAGS = {"--feedback-objective": "feedback_objective", "--min-gain": "min_gain",
               "--feedback-interval": "feedback_interval", "--storage": "storage"}  # fmt: skip
