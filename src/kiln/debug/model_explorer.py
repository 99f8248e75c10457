"""A comparison as node data for Google's Model Explorer (its `--node_data_paths` overlays).

Model Explorer's node-data JSON (`model_explorer.node_data_builder.ModelNodeData`) maps a
graph id — an ONNX graph's name, in its ONNX adapter — to `{"results": {node id: {"value":
number, "bgColor": css}}, ...}`; the ONNX adapter's node ids are the ONNX node names, which
here are the *original* model's. Two files:

* `error.json` — each compared node's error under the comparison's budget (max abs for the
  fp32 tolerance, 1 − cosine otherwise), green within the budget, red beyond it, and the first
  divergence dark red;
* `latency.json` — milliseconds per original node on side B, from the engine's own profiler on
  B's graph as compiled (no tensor exposed), a fused kernel's time shared evenly among the
  original nodes it runs.

JSON has no infinity: an error that is not finite (NaN or inf on one side) is written as
`NOT_FINITE`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import Any

from kiln.debug.compare import Comparison
from kiln.debug.sides import Side
from kiln.home import atomic_write_json

NOT_FINITE = 1e38
WITHIN, BEYOND, FIRST = "#8bc34a", "#ff5722", "#b71c1c"
ERROR_FILE, LATENCY_FILE = "error.json", "latency.json"
_GRADIENT = [{"stop": 0, "bgColor": "#e8f5e9"}, {"stop": 1, "bgColor": "#d32f2f"}]


def error_data(result: dict[str, Any]) -> dict[str, Any]:
    """Node data of a comparison's JSON (`Comparison.to_json()`): each row's error."""
    first = result["first_divergence"]
    metric = result["budget"]["metric"]
    results: dict[str, dict[str, Any]] = {}
    for row in result["layers"]:
        if metric == "cosine" and row["cosine"] is not None:
            value = 1.0 - row["cosine"]
        else:
            value = row["max_abs"]
        colour = FIRST if row["node"] == first else WITHIN if row["ok"] else BEYOND
        prior = results.get(row["node"])
        if prior is None or _finite(value) > prior["value"]:  # a node's worst output
            results[row["node"]] = {"value": _finite(value), "bgColor": colour}
    return {result["graph"]: {"results": results}}


def latency_data(graph: str, milliseconds: dict[str, float]) -> dict[str, Any]:
    results = {node: {"value": round(ms, 6)} for node, ms in milliseconds.items()}
    return {graph: {"results": results, "gradient": _GRADIENT}}


def _finite(value: float | None) -> float:
    if value is None or not math.isfinite(value):
        return NOT_FINITE
    return float(value)


def latency_by_node(side: Side, feeds: dict[str, Any], runs: int = 10) -> dict[str, float]:
    """Median milliseconds per original node on `side`, from the engine's profiler."""
    from kiln.backends import get_backend
    from kiln.profile.aggregate import per_node
    from kiln.profile.mapping import NodeMatcher

    executable = get_backend(side.engine).compile(side.model, side.options)
    profile = executable.profile(feeds, runs)
    kernels = per_node(profile.records, NodeMatcher(side.model), side.provenance)
    milliseconds: dict[str, float] = defaultdict(float)
    for kernel in kernels:
        originals = kernel.get("original") or []
        for name in originals:
            milliseconds[name] += kernel["median_ms"] / len(originals)
    return dict(milliseconds)


def write_model_explorer(
    comparison: Comparison, directory: str | Path, latency_runs: int = 10
) -> list[Path]:
    """Write error.json and (with `latency_runs` > 0) latency.json into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    result = comparison.to_json()
    written = [directory / ERROR_FILE]
    atomic_write_json(written[0], error_data(result))
    if latency_runs > 0:
        milliseconds = latency_by_node(comparison.b, comparison.feeds, latency_runs)
        written.append(directory / LATENCY_FILE)
        atomic_write_json(written[1], latency_data(result["graph"], milliseconds))
    return written
