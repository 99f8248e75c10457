"""A pipeline artifact on many streams, MLPerf MultiStream-shaped, pre- and post-processing
timed: against the same function as users run it today, and against a peer pipeline.

Per stream count N, each way answers every input of the data set with N streams, each stream
taking the next input when its last is answered:
- `kiln`: the artifact by `kiln.Pipeline.map`, each stage's calls pooled across streams;
- `plain`: the artifact's function over its source models, each in ONNX Runtime with its
  default options (ORT_ENABLE_ALL, its own threads and spinning), one thread per stream and
  no pooling: what a user runs without Kiln;
- `peer` (optional): a function of one input (MODULE:FUNCTION), one thread per stream.
Per way: queries, queries/s, P50/P90/P99 per query (and how many queries back the P99), and
the metric against the fp32 pipeline's own results (the `plain` way's). Per stage of `kiln`:
calls, executions, mean batch, compute and queueing time.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import onnx_ir as ir

from kiln.backends import get_backend
from kiln.backends.ort import OrtOptions
from kiln.errors import KilnError
from kiln.pipeline.data import Metric, load_data, load_metric
from kiln.pipeline.function import load_function
from kiln.pipeline.pipeline_artifact import read_pipeline
from kiln.pipeline.recording import call_function
from kiln.pipeline.runtime import Pipeline
from kiln.runtime.metadata import graph_inputs, node_arg

Say = Callable[[str], None]


class PlainSession:
    """A model as users run it: ONNX Runtime with its default options, called as
    onnxruntime.InferenceSession is."""

    def __init__(self, path: str) -> None:
        options = OrtOptions(stop_spinning=False)  # ONNX Runtime's own spinning, as a user has
        self.executable = get_backend("ort").compile(path, options)
        model = ir.load(path)
        self._inputs = [node_arg(v) for v in graph_inputs(model)]
        self._outputs = [node_arg(v) for v in model.graph.outputs]

    def get_inputs(self) -> list[Any]:
        return self._inputs

    def get_outputs(self) -> list[Any]:
        return self._outputs

    def run(self, output_names: list[str] | None, feeds: dict[str, Any], *args: Any) -> list:
        outputs = self.executable.run(feeds)
        if output_names is None:
            return outputs
        index = {o.name: i for i, o in enumerate(self._outputs)}
        return [outputs[index[name]] for name in output_names]


def bench_pipeline(
    artifact: str | os.PathLike,
    data: str | Sequence[Any],
    streams: Sequence[int] = (1, 4, 16),
    against: str | Callable[[Any], Any] | None = None,
    say: Say | None = None,
) -> dict[str, Any]:
    """The figures above for each stream count, as a JSON-ready dict."""
    say = say or (lambda line: None)
    if not streams or min(streams) < 1:
        raise KilnError("--streams: give stream counts of 1 or more, e.g. 1,4,16.")
    inputs = load_data(data)
    function, _stages, manifest = read_pipeline(artifact)
    metric_name, score = _metric(manifest)
    peer = load_function(against) if isinstance(against, str) else against
    say("opening the source models as users run them")
    plain = {n: PlainSession(s["source"]) for n, s in manifest["stages"].items()}
    reference = [call_function(function, x, i, plain) for i, x in enumerate(inputs)]
    out: dict[str, Any] = {"metric": metric_name, "queries": len(inputs), "streams": {}}
    with Pipeline(artifact) as pipe:
        pipe(inputs[0])  # warm: first runs build what engines build once
        for n in streams:
            say(f"{n} streams")
            ways = {
                "kiln": _kiln_way(pipe, inputs, n, reference, score),
                "plain": _way(
                    lambda x, i: call_function(function, x, i, plain), inputs, n, reference, score
                ),  # fmt: skip
            }
            if peer is not None:
                ways["peer"] = _way(lambda x, i: peer(x), inputs, n, reference, score)
            ways["speedup_vs_plain"] = _ratio(ways["kiln"], ways["plain"], "queries_per_s")
            ways["p99_vs_plain"] = _ratio(ways["kiln"], ways["plain"], "p99_ms")
            if peer is not None:
                ways["speedup_vs_peer"] = _ratio(ways["kiln"], ways["peer"], "queries_per_s")
                ways["p99_vs_peer"] = _ratio(ways["kiln"], ways["peer"], "p99_ms")
            out["streams"][str(n)] = ways
    return out


def _metric(manifest: dict[str, Any]) -> tuple[str, Metric]:
    name = manifest["metric"]["name"]
    try:
        return load_metric(name)
    except KilnError:  # a metric given as a Python object in compile_pipeline: not reloadable
        return load_metric("exact")


def _kiln_way(pipe: Pipeline, inputs: list, n: int, reference: list, score: Metric) -> dict:
    start = time.perf_counter()
    results = pipe.map(inputs, streams=n)
    wall = time.perf_counter() - start
    run = pipe.last_run
    assert run is not None  # map just set it
    return {**figures(results, run.seconds, wall, reference, score), "stages": run.stages}


def _way(answer: Callable[[Any, int], Any], inputs: list, n: int, reference: list,
         score: Metric) -> dict:  # fmt: skip
    results, seconds, wall = run_queries(answer, inputs, n)
    return figures(results, seconds, wall, reference, score)


def run_queries(answer: Callable[[Any, int], Any], inputs: list, streams: int):
    """Each of `streams` threads takes the next input when its last is answered; each
    query's result and seconds, in input order, and the wall time."""
    results: list[Any] = [None] * len(inputs)
    seconds = [0.0] * len(inputs)
    queue = iter(range(len(inputs)))
    lock = threading.Lock()

    def stream() -> None:
        while True:
            with lock:
                index = next(queue, None)
            if index is None:
                return
            start = time.perf_counter()
            results[index] = answer(inputs[index], index)
            seconds[index] = time.perf_counter() - start

    start = time.perf_counter()
    with ThreadPoolExecutor(streams, thread_name_prefix="kiln-bench-stream") as pool:
        for done in [pool.submit(stream) for _ in range(streams)]:
            done.result()
    return results, seconds, time.perf_counter() - start


def figures(results: list, seconds: list[float], wall: float, reference: list,
            score: Metric) -> dict[str, Any]:  # fmt: skip
    ms = np.array(seconds) * 1e3
    return {
        "queries": len(results),
        "queries_per_s": round(len(results) / wall, 3),
        # four significant figures: a peer's query may take microseconds
        "p50_ms": float(f"{np.percentile(ms, 50):.4g}"),
        "p90_ms": float(f"{np.percentile(ms, 90):.4g}"),
        "p99_ms": float(f"{np.percentile(ms, 99):.4g}"),
        "p99_backed_by": len(results),  # a P99 over fewer than 100 queries is their maximum
        "metric": round(score(reference, results), 6),
    }


def _ratio(a: dict, b: dict, key: str) -> float | None:
    return round(a[key] / b[key], 4) if b.get(key) else None
