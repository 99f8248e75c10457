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
import statistics
import threading
import time
from collections.abc import Callable, Sequence
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
from kiln.pipeline.streams import on_streams
from kiln.runtime.metadata import graph_inputs, node_arg
from kiln.timing import MIN_ROUNDS_FOR_SPREAD, UNKNOWN, verdict_of

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
    rounds: int = 3,
) -> dict[str, Any]:
    """The figures above for each stream count, as a JSON-ready dict. Each way answers the
    data `rounds` times, the ways taking turns (interleaved, so that they share the machine's
    drift); its queries/s is the median round's, with every round's beside it, and the
    speedups come with the range of the per-round ratios and a verdict (3 rounds or more)."""
    say = say or (lambda line: None)
    if not streams or min(streams) < 1:
        raise KilnError("--streams: give stream counts of 1 or more, e.g. 1,4,16.")
    if rounds < 1:
        raise KilnError(f"--rounds {rounds}: give 1 or more (3 or more to tell from noise).")
    inputs = load_data(data)
    function, _stages, manifest = read_pipeline(artifact)
    metric_name, score = _metric(manifest)
    peer = load_function(against) if isinstance(against, str) else against
    say("opening the source models as users run them")
    plain = {n: PlainSession(s["source"]) for n, s in manifest["stages"].items()}
    reference = [call_function(function, x, i, plain) for i, x in enumerate(inputs)]  # warm too
    out: dict[str, Any] = {"metric": metric_name, "queries": len(inputs), "rounds": rounds,
                           "streams": {}}  # fmt: skip
    with Pipeline(artifact) as pipe:
        pipe(inputs[0])  # warm: first runs build what engines build once
        if peer is not None:
            peer(inputs[0])
        for n in streams:
            passes: dict[str, Callable[[], Pass]] = {
                "kiln": lambda n=n: _kiln_pass(pipe, inputs, n),
                "plain": lambda n=n: (*run_queries(
                    lambda x, i: call_function(function, x, i, plain), inputs, n
                ), None),
            }  # fmt: skip
            if peer is not None:
                passes["peer"] = lambda n=n: (*run_queries(lambda x, i: peer(x), inputs, n), None)
            runs = _interleaved(passes, rounds, lambda r, n=n: say(f"{n} streams, round {r}"))
            ways: dict[str, Any] = {w: _way(p, reference, score) for w, p in runs.items()}
            ways["kiln"]["stages"] = runs["kiln"][-1][3]
            for other in [w for w in ("plain", "peer") if w in runs]:
                ways.update(_versus(ways, other))
            out["streams"][str(n)] = ways
    return out


# One pass of a way over the data: each query's result and seconds, the wall time, and the
# pipeline runtime's per-stage figures (None for the ways without it).
Pass = tuple[list, list[float], float, Any]


def _interleaved(passes: dict[str, Callable[[], Pass]], rounds: int,
                 on_round: Callable[[int], None]) -> dict[str, list[Pass]]:  # fmt: skip
    """Every way's passes, `rounds` of each, the ways taking turns from a shifting start."""
    names, out = list(passes), {name: [] for name in passes}
    for r in range(rounds):
        on_round(r + 1)
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            out[name].append(passes[name]())
    return out


def _kiln_pass(pipe: Pipeline, inputs: list, n: int) -> Pass:
    results = pipe.map(inputs, streams=n)
    run = pipe.last_run
    assert run is not None  # map just set it
    return results, run.seconds, run.wall_s, run.stages


def _way(runs: list[Pass], reference: list, score: Metric) -> dict[str, Any]:
    """A way's figures over its rounds: the median round's queries/s (every round's beside
    it), the latencies of every query of every round, the lowest metric of a round."""
    rates = [len(results) / wall for results, _, wall, _ in runs]
    seconds = [s for _, times, _, _ in runs for s in times]
    ms = np.array(seconds) * 1e3
    return {
        "queries": len(seconds),
        "queries_per_s": round(statistics.median(rates), 3),
        "queries_per_s_rounds": [round(r, 3) for r in rates],
        # four significant figures: a peer's query may take microseconds
        "p50_ms": float(f"{np.percentile(ms, 50):.4g}"),
        "p90_ms": float(f"{np.percentile(ms, 90):.4g}"),
        "p99_ms": float(f"{np.percentile(ms, 99):.4g}"),
        "p99_backed_by": len(seconds),  # a P99 over fewer than 100 queries is their maximum
        "metric": round(min(score(reference, results) for results, *_ in runs), 6),
    }


def _versus(ways: dict[str, Any], name: str) -> dict[str, Any]:
    """Kiln's queries/s over `name`'s (the medians' ratio, the per-round ratios' range and the
    verdict) and its P99 over theirs."""
    pairs = zip(ways["kiln"]["queries_per_s_rounds"], ways[name]["queries_per_s_rounds"],
                strict=True)  # fmt: skip
    ratios = [k / o for k, o in pairs]
    value = _ratio(ways["kiln"], ways[name], "queries_per_s")
    enough = len(ratios) >= MIN_ROUNDS_FOR_SPREAD and value is not None
    low, high = (min(*ratios, value), max(*ratios, value)) if enough else (None, None)
    return {
        f"speedup_vs_{name}": value,
        f"speedup_vs_{name}_spread": [round(low, 4), round(high, 4)] if enough else None,
        f"speedup_vs_{name}_verdict": verdict_of(low, high) if enough else UNKNOWN,
        f"p99_vs_{name}": _ratio(ways["kiln"], ways[name], "p99_ms"),
    }


def _metric(manifest: dict[str, Any]) -> tuple[str, Metric]:
    name = manifest["metric"]["name"]
    try:
        return load_metric(name)
    except KilnError:  # a metric given as a Python object in compile_pipeline: not reloadable
        return load_metric("exact")


def run_queries(answer: Callable[[Any, int], Any], inputs: list, streams: int):
    """Each of `streams` threads takes the next input when its last is answered; each
    query's result and seconds, in input order, and the wall time (from when every thread is
    up: starting threads is not the queries' time)."""
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

    return results, seconds, on_streams(stream, streams, "kiln-bench-stream")


def _ratio(a: dict, b: dict, key: str) -> float | None:
    return round(a[key] / b[key], 4) if b.get(key) else None
