"""Chrome trace event JSON (opens in Perfetto and chrome://tracing): every profiled run's
kernels as complete ("X") events, laid out run after run on one timeline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kiln.profile.aggregate import timeline

_GAP_US = 50.0  # between runs, so each run reads as its own block
_PID, _RUNS_TID, _KERNELS_TID = 1, 1, 2


def trace_events(result: dict[str, Any]) -> dict[str, Any]:
    """The trace as a dict: {"traceEvents": [...], "displayTimeUnit": "ms", ...}."""
    # kernels are known by their key: OpenVINO renames its layers at every profiling compile
    about = {n.get("key", n["node"]): n for n in result["nodes"]}
    names = {key: n["node"] for key, n in about.items()}
    title = f"{result['name']} on {result['backend']['name']}"
    events: list[dict[str, Any]] = [
        _meta("process_name", _RUNS_TID, {"name": title}),
        _meta("thread_name", _RUNS_TID, {"name": "runs"}),
        _meta("thread_name", _KERNELS_TID, {"name": "kernels"}),
    ]
    clock = 0.0
    for run in sorted({r["run"] for r in result["records"]}):
        spans = timeline(result["records"], run, names)
        if not spans:
            continue
        length = max(s["start_us"] + s["dur_us"] for s in spans)
        events.append(_span(f"run {run}", "run", clock, length, _RUNS_TID, {"run": run}))
        for span in spans:
            node = about.get(span["key"], {})
            args = {
                "op_type": span["op_type"],
                "kernel": node.get("kernel", ""),
                "origin": node.get("graph_nodes", []),
                "original": node.get("original", []),
                "precision": node.get("precision", ""),
                "run": run,
            }
            start = clock + span["start_us"]
            events.append(
                _span(span["node"], span["op_type"], start, span["dur_us"], _KERNELS_TID, args)
            )
        clock += length + _GAP_US
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"source": result["source"], "kiln_version": result["kiln_version"]},
    }


def write_trace(result: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(trace_events(result)) + "\n")
    return path


def _span(name: str, cat: str, ts: float, dur: float, tid: int, args: dict) -> dict[str, Any]:
    return {
        "name": name,
        "cat": cat,
        "ph": "X",
        "ts": round(ts, 3),
        "dur": round(dur, 3),
        "pid": _PID,
        "tid": tid,
        "args": args,
    }


def _meta(name: str, tid: int, args: dict) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": _PID, "tid": tid, "args": args}
