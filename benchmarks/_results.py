"""One result schema for every benchmark, written to `benchmarks/results/<suite>/`.

A result file is `<date>-<cpu-class>-<commit>.json`:

    {"schema": 1, "suite": "zoo_vs_ort", "command": ["python", "benchmarks/zoo_vs_ort.py", ...],
     "kiln": {"version": "0.1.0", "commit": "87f4ede", "dirty": false},
     "date": "2026-12-07", "started": "2026-12-07T09:30:00+00:00", "seconds": 212.0,
     "machine": {"cpu", "cpu_class", "cores", "features", "platform", "peaks", "host"},
     "host_end": {"load_average", "other_busy_cores", "shared"},
     "engines": {"onnxruntime": "1.32.0", "openvino": "2026.4.1", "torch": null},
     "rows": [{"label": "resnet-tiny fp32", "value": 1.08, "unit": "x", "spread": [1.01, 1.12],
               "verdict": "faster", "model": "resnet-tiny", "precision": "fp32",
               "engine": "kiln", "baseline": "ort"}],
     "details": {...}}

`rows` are the figures a reader compares (a ratio, a latency, a peak), each with its spread
(lowest and highest per-round value, or null) and verdict (or null where none applies);
`details` keeps everything else the script measured. `docs/benchmarks/` is rendered from these
files by `benchmarks/render.py`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _machine import host_load, machine

SCHEMA = 1
RESULTS = Path(__file__).resolve().parent / "results"
ENGINES = ("onnxruntime", "openvino", "torch")
ROW_TEXT = ("label", "unit", "model", "precision", "engine", "baseline", "verdict")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`--results DIR`: where the schema file goes (default benchmarks/results)."""
    parser.add_argument(
        "--results", type=Path, default=RESULTS,
        help="write the result file under DIR/<suite>/ (default: benchmarks/results)",
    )  # fmt: skip


class Recorder:
    """Started when the benchmark starts (the host's load then), written when it ends."""

    def __init__(self, suite: str) -> None:
        self.suite = suite
        self.argv = ["python", _script(sys.argv[0]), *sys.argv[1:]]
        self.started = dt.datetime.now(dt.timezone.utc)
        self.clock = time.monotonic()
        self.machine = machine()

    def write(self, rows: list[dict[str, Any]], details: Any, results: Path = RESULTS,
              tag: str = "") -> Path:  # fmt: skip
        """The schema file for this run, under `results/<suite>/`; its path. `tag` names a
        variant of the suite's run (`int8`); a file already there is never overwritten."""
        document = {
            "schema": SCHEMA,
            "suite": self.suite,
            "command": self.argv,
            "kiln": kiln_build(),
            "date": self.started.date().isoformat(),
            "started": self.started.isoformat(timespec="seconds"),
            "seconds": round(time.monotonic() - self.clock, 1),
            "machine": self.machine,
            "host_end": host_load(),
            "engines": engine_versions(),
            "rows": rows,
            "details": details,
        }
        problems = validate(document)
        if problems:
            raise ValueError(f"{self.suite}: result does not fit the schema: {problems[0]}")
        name = f"{document['date']}-{self.machine['cpu_class']}-{document['kiln']['commit']}"
        path = _free(Path(results) / self.suite, name + (f"-{tag}" if tag else ""))
        path.write_text(json.dumps(document, indent=2, default=_plain) + "\n")
        print(f"result: {path}", file=sys.stderr)
        return path


def row(label: str, value: float | None, unit: str, spread: Any = None,
        verdict: str | None = None, **columns: Any) -> dict[str, Any]:  # fmt: skip
    """One figure: `value` in `unit`, its spread [low, high] or None, its verdict or None;
    `columns` (model, precision, engine, baseline, ...) say what it is of."""
    low_high = None if spread is None else [float(spread[0]), float(spread[1])]
    number = None if value is None else float(value)
    return {"label": label, "value": number, "unit": unit, "spread": low_high,
            "verdict": verdict, **columns}  # fmt: skip


def speedup_row(label: str, figures: dict[str, Any], **columns: Any) -> dict[str, Any]:
    """A `kiln.timing.Speedup.to_json()` as a row (above 1: faster than the baseline)."""
    return row(label, figures["speedup"], "x", figures["speedup_spread"], figures["verdict"],
               **columns)  # fmt: skip


def bench_rows(model: str, result: dict[str, Any]) -> list[dict[str, Any]]:
    """A `kiln bench` result's rows: each engine's P50 over the baseline's (the first engine
    named), with spread and verdict; `precision` is the engine's, Kiln's as its artifact has."""
    baseline = result["baseline"]
    found = []
    for engine, figures in result["engines"].items():
        if engine == baseline:
            continue
        if engine == "kiln":
            precision = result.get("kiln_build", {}).get("precision", "fp32")
        else:
            precision = next((p for p in ("int8", "bf16") if engine.endswith(p)), "fp32")
        found.append(row(
            f"{model}: {engine} vs {baseline}", figures["speedup_vs_baseline"], "x",
            figures["speedup_spread"], figures["verdict"], model=model, precision=precision,
            engine=engine, baseline=baseline, p50_ms=figures["p50_ms"],
            cosine_vs_fp32=figures.get("cosine_vs_fp32"),
        ))  # fmt: skip
    return found


def kiln_build() -> dict[str, Any]:
    """Kiln's version, and the commit of the checkout the benchmark ran from."""
    import kiln

    here = Path(__file__).resolve().parent
    commit = _git(here, "rev-parse", "--short=7", "HEAD") or "unknown"
    dirty = bool(_git(here, "status", "--porcelain", "--untracked-files=no", "--", "src"))
    return {"version": kiln.__version__, "commit": commit, "dirty": dirty}


def engine_versions() -> dict[str, str | None]:
    versions = {}
    for name in ENGINES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def validate(document: Any) -> list[str]:
    """What in `document` breaks the schema ([] when nothing does)."""
    if not isinstance(document, dict):
        return ["not a JSON object"]
    problems = []
    expected = {"schema": int, "suite": str, "command": list, "kiln": dict, "date": str,
                "machine": dict, "engines": dict, "rows": list}  # fmt: skip
    for key, kind in expected.items():
        if not isinstance(document.get(key), kind):
            problems.append(f"{key}: missing or not a {kind.__name__}")
    if problems:
        return problems
    if document["schema"] != SCHEMA:
        problems.append(f"schema: {document['schema']} is not {SCHEMA}")
    for key in ("version", "commit"):
        if not isinstance(document["kiln"].get(key), str):
            problems.append(f"kiln.{key}: missing")
    for key, kind in (("cpu", str), ("cpu_class", str), ("cores", int), ("features", list)):
        if not isinstance(document["machine"].get(key), kind):
            problems.append(f"machine.{key}: missing or not a {kind.__name__}")
    if not isinstance(document["machine"].get("host"), dict):
        problems.append("machine.host: missing (the host's load at the start)")
    for index, item in enumerate(document["rows"]):
        problems += [f"rows[{index}]: {p}" for p in _row_problems(item)]
    return problems


def _row_problems(item: Any) -> list[str]:
    if not isinstance(item, dict):
        return ["not an object"]
    problems = []
    if not isinstance(item.get("label"), str) or not isinstance(item.get("unit"), str):
        problems.append("label and unit must be text")
    if item.get("value") is not None and not isinstance(item["value"], int | float):
        problems.append("value must be a number or null")
    spread = item.get("spread")
    if spread is not None and not (
        isinstance(spread, list) and len(spread) == 2
        and all(isinstance(v, int | float) for v in spread)
    ):  # fmt: skip
        problems.append("spread must be [low, high] or null")
    if item.get("verdict") is not None and not isinstance(item["verdict"], str):
        problems.append("verdict must be text or null")
    for key, value in item.items():
        if not isinstance(value, str | int | float | bool | list | type(None)):
            problems.append(f"{key}: a row holds scalars")
    return problems


def load(path: Path) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


def _git(where: Path, *args: str) -> str:
    try:
        done = subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True,
                              timeout=30)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def _free(folder: Path, name: str) -> Path:
    """`folder/name.json`, or `name-2.json`, `name-3.json`... where that exists."""
    folder.mkdir(parents=True, exist_ok=True)
    path, count = folder / f"{name}.json", 1
    while path.exists():
        count += 1
        path = folder / f"{name}-{count}.json"
    return path


def _script(path: str) -> str:
    """The script as run from the repository's root (benchmarks/NAME.py) when it is one of
    these benchmarks, wherever the checkout lies; else as given."""
    here = Path(path).resolve()
    if here.parent == Path(__file__).resolve().parent:
        return f"benchmarks/{here.name}"
    return path


def _plain(value: Any) -> Any:
    """numpy scalars, paths and tuples as JSON has them."""
    if hasattr(value, "item"):
        return value.item()
    return str(value)
