"""Prometheus metrics for one server: a registry of its own (so two apps in one process, as in
tests, never share counters), request and batch figures recorded as they happen, and the
session's runtime figures (bucket hits and misses, padding waste, recompiles, swaps) read from
`session.stats()` at scrape time, so they are never stale and never double-counted."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kiln.runtime.batcher import BatchRecord

_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ServeMetrics:
    def __init__(self, model: str, stats: Callable[[], dict[str, Any]]) -> None:
        self.model = model
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model"]
        self.requests = Counter(
            "kiln_requests", "Inference requests received", labels, registry=r
        ).labels(model)
        self._failures = Counter(
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
        ).labels(model)
        self._queue_time = Histogram(
            "kiln_queue_time_seconds",
            "Time a request waited in the batching queue",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(model)
        self._run_time = Histogram(
            "kiln_batch_run_seconds",
            "Time the engine took for one batch",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        ).labels(model)
        self._batch_samples = Histogram(
            "kiln_batch_size", "Samples per executed batch", labels, buckets=_SIZE_BUCKETS,
            registry=r,
        ).labels(model)  # fmt: skip
        self._batch_requests = Histogram(
            "kiln_batch_requests", "Requests per executed batch", labels, buckets=_SIZE_BUCKETS,
            registry=r,
        ).labels(model)  # fmt: skip
        self.queue_depth = Gauge(
            "kiln_queue_depth", "Requests waiting in the batching queue", labels, registry=r
        ).labels(model)
        r.register(SessionStats(model, stats))

    def failure(self, code: int) -> None:
        self._failures.labels(self.model, str(code)).inc()

    def observe_batch(self, record: BatchRecord) -> None:
        """Called by the batcher's worker after each batch."""
        self._batch_samples.observe(record.samples)
        self._batch_requests.observe(record.requests)
        self._run_time.observe(record.run_time)
        for wait in record.queue_times:
            self._queue_time.observe(wait)


class SessionStats(Collector):
    """The session's runtime figures (`Session.stats()`), read at scrape time."""

    COUNTERS = {
        "hits": "Requests routed to a shape bucket",
        "misses": "Requests no bucket held (run on the dynamic executable)",
        "recompiles": "Bucket sets built in the background",
        "swaps": "Bucket sets swapped in while serving",
    }

    def __init__(self, model: str, stats: Callable[[], dict[str, Any]]) -> None:
        self.model, self.stats = model, stats

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self.stats()
        except Exception:  # a scrape must never fail because the session is busy
            return
        m = [self.model]
        for key, doc in self.COUNTERS.items():
            family = CounterMetricFamily(f"kiln_bucket_{key}", doc, labels=["model"])
            family.add_metric(m, float(stats.get(key, 0)))
            yield family
        waste = GaugeMetricFamily(
            "kiln_padding_waste_ratio",
            "Share of executed input elements that were padding, overall and per bucket",
            labels=["model", "bucket"],
        )
        waste.add_metric([*m, "all"], float(stats.get("padding_waste", 0.0)))
        runs = CounterMetricFamily(
            "kiln_bucket_runs",
            "Engine runs per bucket ('dynamic': misses)",
            labels=["model", "bucket"],
        )
        p99 = GaugeMetricFamily(
            "kiln_bucket_p99_seconds",
            "Engine P99 per bucket, recent runs",
            labels=["model", "bucket"],
        )
        for bucket, figures in sorted(stats.get("buckets", {}).items()):
            waste.add_metric([*m, bucket], float(figures.get("padding_waste", 0.0)))
            runs.add_metric([*m, bucket], float(figures.get("runs", 0)))
            p99.add_metric([*m, bucket], float(figures.get("p99_ms", 0.0)) / 1e3)
        yield from (waste, runs, p99)
        decisions = CounterMetricFamily(
            "kiln_runtime_decisions", "Decisions the adaptive runtime logged", labels=["model"]
        )
        decisions.add_metric(m, float(len(stats.get("decisions", []))))
        yield decisions
