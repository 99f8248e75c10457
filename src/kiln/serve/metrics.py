"""What one server counts, in two views: Prometheus metrics (one registry per server, every
family labelled by model) and Triton's statistics JSON (the `statistics` extension, per model).
Both are fed by the same two recording points, so they agree: `answered` once per inference
request, and the `executions` wrapper around the session's `run_batch` once per batch run. The
sessions' runtime figures (bucket hits and misses, padding waste, recompiles, swaps) are read
from `session.stats()` at scrape time, so they are never stale and never double-counted."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kiln.runtime.batcher import Feeds, RunBatch, samples_of

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class TimedFeeds(dict):
    """A request's feeds on their way through the batcher, stamped with the phases Triton's
    statistics count per request: the app stamps its own (decoding, queueing, encoding), the
    `executions` wrapper the run of the batch the request joined. The stamps ride on the feeds
    because the feeds are all the batcher hands to `run_batch`."""

    __slots__ = ("decode_s", "submitted", "run_start", "run_s", "encode_s")

    def __init__(self, feeds: Feeds) -> None:
        super().__init__(feeds)
        self.decode_s = self.encode_s = self.run_s = 0.0
        self.submitted = self.run_start = 0.0  # time.perf_counter() readings


@dataclass
class Duration:
    """Triton's StatisticDuration: how many, and their nanoseconds summed."""

    count: int = 0
    ns: int = 0

    def add(self, seconds: float, times: int = 1) -> None:
        # Floored per event: a request's phases then never sum past its whole.
        self.count += times
        self.ns += int(seconds * 1e9) * times

    def to_json(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


PHASES = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")


class ModelStatistics:
    """Triton's statistics for one model version (its ModelStatistics message, as JSON).

    Per request, as Triton counts them: `success` and `fail` the whole time from receiving the
    request to answering it; for a success, `queue` the wait in the batcher, `compute_input`
    decoding the body into tensors and checking them, `compute_infer` the run of the batch it
    joined (the whole batch's time, for each request in it), `compute_output` encoding the
    answer. Per run: `execution_count` successful batch runs, `inference_count` the samples
    (batch rows) they answered, `batch_stats` runs and their time per batch size (inputs and
    outputs are prepared per request, so their per-batch figures stay 0).

    Thread-safe: the batcher's worker records runs while the event loop records answers.
    """

    def __init__(self, name: str, version: str) -> None:
        self.name, self.version = name, version
        self._lock = threading.Lock()
        self._phases = {phase: Duration() for phase in PHASES}
        self._batches: dict[int, Duration] = {}
        self._inferences = self._executions = self._last_ms = 0

    def executed(self, samples: int, seconds: float) -> None:
        """One successful batch run of `samples` rows."""
        with self._lock:
            self._executions += 1
            self._inferences += samples
            self._batches.setdefault(samples, Duration()).add(seconds)
            self._last_ms = time.time_ns() // 1_000_000

    def succeeded(self, seconds: float, feeds: TimedFeeds) -> None:
        with self._lock:
            p = self._phases
            p["success"].add(seconds)
            p["queue"].add(max(feeds.run_start - feeds.submitted, 0.0))
            p["compute_input"].add(feeds.decode_s)
            p["compute_infer"].add(feeds.run_s)
            p["compute_output"].add(feeds.encode_s)

    def failed(self, seconds: float) -> None:
        with self._lock:
            self._phases["fail"].add(seconds)

    def to_json(self) -> dict[str, Any]:
        with self._lock:
            unprepared = Duration().to_json()
            batches = [
                {"batch_size": size, "compute_input": unprepared,
                 "compute_infer": runs.to_json(), "compute_output": unprepared}
                for size, runs in sorted(self._batches.items())
            ]  # fmt: skip
            return {
                "name": self.name,
                "version": self.version,
                "last_inference": self._last_ms,
                "inference_count": self._inferences,
                "execution_count": self._executions,
                "inference_stats": {k: d.to_json() for k, d in self._phases.items()},
                "batch_stats": batches,
            }


class ServerMetrics:
    """One server's Prometheus registry (its own, so two servers in one process, as in tests,
    never share counters). Every family is labelled by `model`, so one scrape covers every model
    the server holds; `model(name, version)` hands one model its view. The queue depth and the
    session's runtime figures are read at scrape time from `live()`, the models served then: an
    unloaded model's gauges leave with it, while its counters stay (a counter that vanished
    and came back at 0 would read as a reset)."""

    def __init__(self, live: Callable[[], list[Observed]]) -> None:
        self.registry = r = CollectorRegistry()
        labels = ["model"]
        self.requests = Counter("kiln_requests", "Inference requests received", labels, registry=r)
        self.failures = Counter(
            "kiln_request_failures",
            "Inference requests answered with an error, by HTTP status",
            ["model", "code"],
            registry=r,
        )
        self.latency = Histogram(
            "kiln_request_latency_seconds",
            "Time from receiving an inference request to sending its answer",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "kiln_queue_time_seconds",
            "Time an answered request waited in the batching queue",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.run_time = Histogram(
            "kiln_batch_run_seconds",
            "Time the engine took for one batch",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_samples = Histogram(
            "kiln_batch_size", "Samples per executed batch", labels, buckets=_SIZE_BUCKETS,
            registry=r,
        )  # fmt: skip
        self.batch_requests = Histogram(
            "kiln_batch_requests", "Requests per executed batch", labels, buckets=_SIZE_BUCKETS,
            registry=r,
        )  # fmt: skip
        r.register(LiveModels(live))
        # process_resident_memory_bytes and the rest of Prometheus' process metrics, and the
        # peak beside them: what the machine must have free for this server.
        ProcessCollector(registry=r)
        r.register(PeakMemory())

    def model(self, name: str, version: str) -> ServeMetrics:
        """What one model (one version of it) counts, under its `model` label."""
        return ServeMetrics(self, name, version)


class ServeMetrics:
    """One model's view of the server's metrics, and its Triton statistics (per version, as
    Triton keeps them)."""

    def __init__(self, server: ServerMetrics, model: str, version: str) -> None:
        self.model = model
        self.statistics = ModelStatistics(model, version)
        self._failures = server.failures
        self.requests = server.requests.labels(model)
        self._latency = server.latency.labels(model)
        self._queue_time = server.queue_time.labels(model)
        self._run_time = server.run_time.labels(model)
        self._batch_samples = server.batch_samples.labels(model)
        self._batch_requests = server.batch_requests.labels(model)

    def answered(self, seconds: float, status: int | None, feeds: TimedFeeds | None) -> None:
        """One inference request answered after `seconds`: `status` None for a success (then
        `feeds` holds its stamps), else the HTTP status it was refused with."""
        self._latency.observe(seconds)
        if status is None and feeds is not None:
            self._queue_time.observe(max(feeds.run_start - feeds.submitted, 0.0))
            self.statistics.succeeded(seconds, feeds)
        else:
            self._failures.labels(self.model, str(status)).inc()
            self.statistics.failed(seconds)

    def executions(self, run_batch: RunBatch) -> RunBatch:
        """`run_batch`, recording each call as one batch run (the time of a failed one too, in
        /metrics; Triton counts successful ones only) and stamping its requests' feeds."""

        def run(requests: list[Feeds]) -> list[list[np.ndarray]]:
            start = time.perf_counter()
            samples = sum(samples_of(feeds) for feeds in requests)
            try:
                outputs = run_batch(requests)
            finally:
                seconds = time.perf_counter() - start
                self._run_time.observe(seconds)
                self._batch_samples.observe(samples)
                self._batch_requests.observe(len(requests))
            # Before the batcher answers: a client holding its answer finds it counted.
            self.statistics.executed(samples, seconds)
            for feeds in requests:
                if isinstance(feeds, TimedFeeds):
                    feeds.run_start, feeds.run_s = start, seconds
            return outputs

        return run


class Observed(Protocol):
    """What the scrape reads of a model served: its name, queue and session figures."""

    name: str

    @property
    def depth(self) -> int: ...

    def stats(self) -> dict[str, Any]: ...


class PeakMemory(Collector):
    """The server process's peak resident memory: the kernel's high-water mark (VmHWM)."""

    def collect(self) -> Iterator[Metric]:
        from kiln.runtime.footprint import peak_rss_mib

        yield GaugeMetricFamily(
            "kiln_process_peak_resident_memory_bytes",
            "Peak resident memory of the server process since it started (VmHWM)",
            value=peak_rss_mib() * 2**20,
        )


class LiveModels(Collector):
    """Per model served at scrape time: its queue depth and its session's runtime figures
    (`Session.stats()`). Each family is built once across the models: a name may appear once
    per scrape."""

    COUNTERS = {
        "hits": "Requests routed to a shape bucket",
        "misses": "Requests no bucket held (run on the dynamic executable)",
        "recompiles": "Bucket sets built in the background",
        "swaps": "Bucket sets swapped in while serving",
    }

    def __init__(self, live: Callable[[], list[Observed]]) -> None:
        self.live = live

    def collect(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily(
            "kiln_queue_depth", "Requests waiting in the batching queue", labels=["model"]
        )
        counters = {
            key: CounterMetricFamily(f"kiln_bucket_{key}", doc, labels=["model"])
            for key, doc in self.COUNTERS.items()
        }
        by_bucket = ["model", "bucket"]
        waste = GaugeMetricFamily(
            "kiln_padding_waste_ratio",
            "Share of executed input elements that were padding, overall and per bucket",
            labels=by_bucket,
        )
        runs = CounterMetricFamily(
            "kiln_bucket_runs", "Engine runs per bucket ('dynamic': misses)", labels=by_bucket
        )
        p99 = GaugeMetricFamily(
            "kiln_bucket_p99_seconds", "Engine P99 per bucket, recent runs", labels=by_bucket
        )
        decisions = CounterMetricFamily(
            "kiln_runtime_decisions", "Decisions the adaptive runtime logged", labels=["model"]
        )
        for model in self.live():
            depth.add_metric([model.name], float(model.depth))
            try:
                stats = model.stats()
            except Exception:  # a scrape must never fail because a session is busy
                continue
            m = [model.name]
            for key, family in counters.items():
                family.add_metric(m, float(stats.get(key, 0)))
            waste.add_metric([*m, "all"], float(stats.get("padding_waste", 0.0)))
            for bucket, figures in sorted(stats.get("buckets", {}).items()):
                waste.add_metric([*m, bucket], float(figures.get("padding_waste", 0.0)))
                runs.add_metric([*m, bucket], float(figures.get("runs", 0)))
                p99.add_metric([*m, bucket], float(figures.get("p99_ms", 0.0)) / 1e3)
            decisions.add_metric(m, float(len(stats.get("decisions", []))))
        yield depth
        yield from counters.values()
        yield from (waste, runs, p99, decisions)
