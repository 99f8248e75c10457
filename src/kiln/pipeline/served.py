"""A pipeline artifact served as one model: what `kiln serve` and Triton's clients see.

One BYTES input `input` (each element one query: an encoded image, a text, any bytes the
function takes — it receives them as `bytes`) and one BYTES output `output` (each query's
result as JSON). Both lead with the batch dim, so the server's dynamic batcher merges
concurrent requests; a merged batch runs as that many streams at once, each model's calls
pooled across them (streams.py). `stats()` adds up each stage's calls, executions and times.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from kiln.errors import KilnError
from kiln.pipeline.runtime import Pipeline
from kiln.runtime.metadata import NodeArg

INPUT, OUTPUT, BATCH = "input", "output", "batch"
PROVIDER = "kiln:pipeline"  # what runs it: Kiln's pipeline runtime, not one engine


class PipelineSession:
    """The session-like face of a pipeline artifact (see the module docstring)."""

    def __init__(self, path: str | os.PathLike, max_streams: int = 16) -> None:
        self.pipeline = Pipeline(path)
        self.max_streams = max_streams
        self._totals: dict[str, dict[str, float]] = {}
        self._queries = 0
        self._runs: list[tuple[int, float]] = []  # (queries, seconds) per call, not yet read
        self._lock = threading.Lock()

    inputs = [{"name": INPUT, "datatype": "BYTES", "shape": [-1]}]
    outputs = [{"name": OUTPUT, "datatype": "BYTES", "shape": [-1]}]
    output_names = [OUTPUT]
    batch_dims = [BATCH]

    def get_inputs(self) -> list[NodeArg]:
        # Not an ONNX string: any bytes, text or not (the server refuses only a text input's)
        return [NodeArg(INPUT, "bytes", [BATCH])]

    def get_outputs(self) -> list[NodeArg]:
        return [NodeArg(OUTPUT, "tensor(string)", [BATCH])]

    def get_providers(self) -> list[str]:
        return [PROVIDER]

    def check_feeds(self, feeds: Mapping[str, Any]) -> dict[str, Any]:
        _items(feeds)
        return dict(feeds)

    def run(
        self, output_names: list[str] | None, feeds: Mapping[str, Any], *args: Any
    ) -> list[np.ndarray]:
        return self.run_batch([dict(feeds)])[0]

    def run_batch(self, requests: list[Mapping[str, Any]]) -> list[list[np.ndarray]]:
        """Every query of every request, run as streams together; each request's results."""
        queries = [_query(item) for feeds in requests for item in _items(feeds)]
        streams = max(1, min(len(queries), self.max_streams))
        start = time.perf_counter()
        results = self.pipeline.map(queries, streams=streams)
        self._count(len(queries), time.perf_counter() - start)
        answers, start = [], 0
        for feeds in requests:
            count = len(_items(feeds))
            encoded = [to_json(r) for r in results[start : start + count]]
            answers.append([np.array(encoded, dtype=object)])
            start += count
        return answers

    def engine_runs(self) -> list[tuple[int, float]]:
        """The calls run since the last read, each one execution of all its requests'
        queries as streams together (what the server counts as a batch)."""
        with self._lock:
            runs, self._runs = self._runs, []
        return runs

    def _count(self, queries: int, seconds: float) -> None:
        run = self.pipeline.last_run
        with self._lock:
            self._queries += queries
            self._runs.append((queries, seconds))
            for name, figures in (run.stages if run else {}).items():
                total = self._totals.setdefault(name, {})
                for key in ("calls", "executions", "compute_ms"):
                    total[key] = total.get(key, 0) + figures[key]
                total["queue_ms"] = total.get("queue_ms", 0) + (
                    figures["queue_ms_per_call"] * figures["calls"]
                )

    def stats(self) -> dict[str, Any]:
        """Queries answered, and per stage its calls, executions, mean batch and times."""
        with self._lock:
            stages = {
                name: {**t, "mean_batch": round(t["calls"] / t["executions"], 3)
                       if t.get("executions") else 0.0}
                for name, t in self._totals.items()
            }  # fmt: skip
            return {"queries": self._queries, "stages": stages}

    def close(self) -> None:
        self.pipeline.close()


def _items(feeds: Mapping[str, Any]) -> list[Any]:
    if INPUT not in feeds:
        raise KilnError(f"a pipeline takes one BYTES input named {INPUT!r}.")
    return list(np.asarray(feeds[INPUT], dtype=object).reshape(-1))


def _query(item: Any) -> bytes:
    """The query as the function receives it: bytes (the wire hands UTF-8 elements as text)."""
    return item.encode("utf-8", "surrogatepass") if isinstance(item, str) else bytes(item)


def to_json(result: Any) -> bytes:
    """A result as JSON: numpy arrays as lists, numpy scalars as numbers."""
    return json.dumps(result, default=_plain, ensure_ascii=False).encode()


def _plain(value: Any) -> Any:
    """JSON for what a pipeline may return beside plain values: arrays and numpy scalars."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    raise TypeError(f"the pipeline's result holds {type(value).__name__}, which JSON cannot hold")
