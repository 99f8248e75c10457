"""What one server counts, in three views: Kiln's Prometheus metrics (one registry per server,
every family labelled by model), Triton's Prometheus counters (`nv_inference_*`, labelled by
model and version, with Triton's meaning) and Triton's statistics JSON (the `statistics`
extension, per model version). All are fed by the same two recording points: `answered`
once per inference request, and the `executions` wrapper around the session's `run_batch` once
per batch, counting the engine executions the session records for it. So they agree while a
model stays loaded; on a load they part: the statistics describe the model as loaded now and
start again at 0, while the Prometheus counters never go down in a server's life. The
sessions' runtime figures (bucket hits and misses, padding waste, recompiles, swaps) are read
from `session.stats()` at scrape time, so they are never stale and never double-counted.

Metric names (docs/reference/metrics.md says each one's meaning):
Triton's, cumulative counters, durations in microseconds over successful requests —
nv_inference_request_success, nv_inference_request_failure, nv_inference_count,
nv_inference_exec_count, nv_inference_request_duration_us, nv_inference_queue_duration_us,
nv_inference_compute_input_duration_us, nv_inference_compute_infer_duration_us,
nv_inference_compute_output_duration_us.
Kiln's — kiln_requests_total, kiln_request_failures_total{code}, the histograms
kiln_request_latency_seconds, kiln_queue_time_seconds, kiln_batch_run_seconds,
kiln_batch_size and kiln_batch_requests; read at scrape time: kiln_queue_depth,
kiln_bucket_{hits,misses,recompiles,swaps}_total, kiln_padding_waste_ratio{bucket},
kiln_bucket_runs_total{bucket}, kiln_bucket_p99_seconds{bucket},
kiln_runtime_decisions_total; the process's: process_* and
kiln_process_peak_resident_memory_bytes.
"""

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

    __slots__ = ("decode_s", "submitted", "run_start", "run_s", "encode_s", "batch_size")

    def __init__(self, feeds: Feeds) -> None:
        super().__init__(feeds)
        self.decode_s = self.encode_s = self.run_s = 0.0
        self.submitted = self.run_start = 0.0  # time.perf_counter() readings
        self.batch_size = 0  # the executed batch its encoding is counted under (batch_stats)


@dataclass
class Duration:
    """Triton's StatisticDuration: how many, and their nanoseconds summed."""

    count: int = 0
    ns: int = 0

    def add(self, seconds: float, times: int = 1) -> None:
        # Floored per event: a request's phases then never sum past its whole. `times` 0 adds
        # time to events counted elsewhere (a batch's requests, counted per execution).
        self.count += times
        self.ns += int(seconds * 1e9) * max(times, 1)

    def to_json(self) -> dict[str, int]:
        return {"count": self.count, "ns": self.ns}


PHASES = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")
BATCH_PHASES = ("compute_input", "compute_infer", "compute_output")
Run = tuple[int, float]  # one engine execution: its batch size (rows), its seconds


class ModelStatistics:
    """Triton's statistics for one model version (its ModelStatistics message, as JSON).

    Per request, as Triton counts them: `success` and `fail` the whole time from receiving the
    request to answering it; for a success, `queue` the wait in the batcher, `compute_input`
    decoding the body into tensors and checking them, `compute_infer` the run of the batch it
    joined (the whole batch's time, for each request in it), `compute_output` encoding the
    answer. Per engine execution (what the session really ran: a batch it could not run as one
    is several): `execution_count` successful executions, `inference_count` the samples (batch
    rows; one per request for a model without a batch axis) they answered, `batch_stats` per
    executed batch size: executions, and their engine time (`compute_infer`), the decoding of
    the requests in them (`compute_input`) and the encoding of their answers
    (`compute_output`); inputs and outputs are prepared per request, so a batch's figure is
    its requests' sum.

    Thread-safe: the batcher's worker records runs while the event loop records answers.
    """

    def __init__(self, name: str, version: str) -> None:
        self.name, self.version = name, version
        self._lock = threading.Lock()
        self._phases = {phase: Duration() for phase in PHASES}
        self._batches: dict[int, dict[str, Duration]] = {}
        self._inferences = self._executions = self._last_ms = 0

    def executed(self, samples: int, runs: list[Run], decode_s: float) -> int:
        """One successful call of the session's `run_batch`, answering `samples` rows through
        `runs`, its engine executions; `decode_s` is its requests' decoding. Returns the batch
        size its requests' encoding is to be counted under (`succeeded`): that of its largest
        execution, where most of its rows ran."""
        with self._lock:
            self._executions += len(runs)
            self._inferences += samples
            for size, seconds in runs:
                batch = self._batch(size)
                batch["compute_infer"].add(seconds)
                batch["compute_input"].count += 1
                batch["compute_output"].count += 1
            self._last_ms = time.time_ns() // 1_000_000
            if not runs:
                return 0
            largest = max(size for size, _ in runs)
            self._batches[largest]["compute_input"].add(decode_s, times=0)
            return largest

    def _batch(self, size: int) -> dict[str, Duration]:
        batch = self._batches.get(size)
        if batch is None:
            batch = self._batches[size] = {p: Duration() for p in BATCH_PHASES}
        return batch

    def succeeded(self, seconds: float, feeds: TimedFeeds) -> None:
        with self._lock:
            p = self._phases
            p["success"].add(seconds)
            p["queue"].add(max(feeds.run_start - feeds.submitted, 0.0))
            p["compute_input"].add(feeds.decode_s)
            p["compute_infer"].add(feeds.run_s)
            p["compute_output"].add(feeds.encode_s)
            if feeds.batch_size in self._batches:
                self._batches[feeds.batch_size]["compute_output"].add(feeds.encode_s, times=0)

    def failed(self, seconds: float) -> None:
        with self._lock:
            self._phases["fail"].add(seconds)

    def totals(self) -> dict[str, int]:
        """Triton's Prometheus counters (the nv_inference_* names, see TritonMetrics)."""
        with self._lock:
            p = self._phases
            return {
                "request_success": p["success"].count,
                "request_failure": p["fail"].count,
                "count": self._inferences,
                "exec_count": self._executions,
                "request_duration_us": p["success"].ns // 1000,
                "queue_duration_us": p["queue"].ns // 1000,
                "compute_input_duration_us": p["compute_input"].ns // 1000,
                "compute_infer_duration_us": p["compute_infer"].ns // 1000,
                "compute_output_duration_us": p["compute_output"].ns // 1000,
            }

    def to_json(self) -> dict[str, Any]:
        with self._lock:
            batches = [
                {"batch_size": size, **{p: d.to_json() for p, d in phases.items()}}
                for size, phases in sorted(self._batches.items())
            ]
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
        self.triton = TritonMetrics()  # beside the registry: see its docstring
        # process_resident_memory_bytes and the rest of Prometheus' process metrics, and the
        # peak beside them: what the machine must have free for this server.
        ProcessCollector(registry=r)
        r.register(PeakMemory())

    def model(self, name: str, version: str) -> ServeMetrics:
        """What one model (one version of it) counts, under its `model` label."""
        metrics = ServeMetrics(self, name, version)
        self.triton.add(metrics.statistics)
        return metrics


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

    def executions(
        self, run_batch: RunBatch, engine_runs: EngineRuns | None, batched: bool = True
    ) -> RunBatch:
        """`run_batch`, recording each call (the time of a failed one too, in /metrics; Triton
        counts successful ones only) and stamping its requests' feeds. `engine_runs` says what
        the engine executed during a call; without it (a session that runs requests one after
        another) each request is run, and counted, as one execution. `batched`: the model has
        a batch axis (else each request is one inference, as Triton counts it)."""

        def run(requests: list[Feeds]) -> list[list[np.ndarray]]:
            if engine_runs is None and len(requests) > 1:
                return [one for feeds in requests for one in run([feeds])]
            start = time.perf_counter()
            samples = sum(samples_of(f) for f in requests) if batched else len(requests)
            try:
                outputs = run_batch(requests)
            except Exception:
                if engine_runs is not None:
                    engine_runs()  # what ran for a failed call is not counted (as in Triton)
                raise
            finally:
                seconds = time.perf_counter() - start
                self._run_time.observe(seconds)
                self._batch_samples.observe(samples)
                self._batch_requests.observe(len(requests))
            # Without the engine's own record, the call was one execution. (With it, a call
            # may find none: a batch run beside it took them, and counted them.)
            runs = engine_runs() if engine_runs is not None else [(samples, seconds)]
            if not batched:  # Triton: without a batch axis every execution is of size 1
                runs = [(1, run_s) for _, run_s in runs]
            timed = [feeds for feeds in requests if isinstance(feeds, TimedFeeds)]
            # Before the batcher answers: a client holding its answer finds it counted.
            size = self.statistics.executed(samples, runs, sum(f.decode_s for f in timed))
            for feeds in timed:
                feeds.run_start, feeds.run_s, feeds.batch_size = start, seconds, size
            return outputs

        return run


EngineRuns = Callable[[], list[Run]]  # the engine executions since the last call


def engine_runs(session: Any) -> EngineRuns | None:
    """The engine executions a `kiln.Session` records in its load monitor, read since the last
    call (a cursor past the last one read): each one's batch size (its batch dim; 1 for a
    model without one) and engine seconds. A session that keeps its own (a pipeline: each
    call runs all its requests' queries as streams together) answers with its `engine_runs`.
    None for a session without that record."""
    own = getattr(session, "engine_runs", None)
    if callable(own):
        return own
    monitor = getattr(session, "monitor", None)
    if monitor is None or not hasattr(monitor, "since"):
        return None
    first = session.get_inputs()[0].shape if session.get_inputs() else []
    dim = first[0] if first and first[0] in set(session.batch_dims) else None
    _, cursor = monitor.since(0)  # the runs before serving (warm-up) are not the server's
    lock = threading.Lock()  # batches run side by side (instance_group) share the cursor

    def since() -> list[Run]:
        nonlocal cursor
        with lock:
            fresh, cursor = monitor.since(cursor)
        return [(obs.dims.get(dim, 1) if dim else 1, obs.seconds) for obs in fresh]

    return since


class Observed(Protocol):
    """What the scrape reads of a model served: its name, queue and session figures."""

    name: str

    @property
    def depth(self) -> int: ...

    def stats(self) -> dict[str, Any]: ...


class TritonMetrics:
    """Triton's per-model counters under Triton's names, labels (`model`, `version`) and
    meaning, so that dashboards and alerts written for Triton read a Kiln server unchanged.
    Read at scrape time from the models' statistics (one source: /metrics and /stats agree
    while a model stays loaded). A version loaded again adds to its counters rather than
    restarting them as its /stats do (a counter never goes down in a server's life); an
    unloaded model's counters stay, as a counter that vanished and came back at 0 would read
    as a reset. Written as text of its own (`exposition`): prometheus_client would name every
    counter "..._total", which Triton's are not."""

    NAMES = {
        "request_success": "Number of successful inference requests (a batch counts as 1)",
        "request_failure": "Number of failed inference requests (a batch counts as 1)",
        "count": "Number of inferences performed (a batch of n counts as n)",
        "exec_count": "Number of inference batch executions",
        "request_duration_us": "Cumulative end-to-end inference request handling time (us)",
        "queue_duration_us": "Cumulative time requests spend waiting in the scheduling queue (us)",
        "compute_input_duration_us": "Cumulative time requests spend processing inputs (us)",
        "compute_infer_duration_us": "Cumulative time requests spend executing the model (us)",
        "compute_output_duration_us": "Cumulative time requests spend processing outputs (us)",
    }

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._statistics: dict[tuple[str, str], list[ModelStatistics]] = {}

    def add(self, statistics: ModelStatistics) -> None:
        with self._lock:
            key = (statistics.name, statistics.version)
            self._statistics.setdefault(key, []).append(statistics)

    def exposition(self) -> str:
        """The counters in Prometheus' text format, each family once, every model in it."""
        with self._lock:
            models = {key: list(loads) for key, loads in sorted(self._statistics.items())}
        totals = {key: [stats.totals() for stats in loads] for key, loads in models.items()}
        lines = []
        for key, doc in self.NAMES.items():
            name = f"nv_inference_{key}"
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} counter"]
            for (model, version), loads in totals.items():
                labels = f'model="{_label(model)}",version="{_label(version)}"'
                lines.append(f"{name}{{{labels}}} {sum(t[key] for t in loads)}")
        return "\n".join(lines) + "\n"


def _label(value: str) -> str:
    """A label value escaped as Prometheus' text format wants it."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


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
