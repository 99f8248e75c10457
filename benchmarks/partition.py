"""A two-tower model partitioned across engines against the best single-engine build.

    python benchmarks/partition.py [--model zoo:two-tower] [--rounds 7] [--runs 10]
                                   [--out results/partition.json]

Builds, from MODEL: the fp32 artifact on ONNX Runtime, on OpenVINO, and `--backend auto`'s
pick; then `--partition auto`, whose record gives each part's time on each engine (at the
threads it gets), the placement chosen from them with its predicted time, and whether the
partitioned build beat the best single engine at compile time. When it did not, the chosen
placement is built anyway (as an explicit placement) so that it can be measured here. Every
artifact then runs through kiln.Session, with the original under ONNX Runtime as-is, in
interleaved rounds in one process; the partitioned build's ratio to each single-engine one is
the median of per-round P50 ratios, with its spread and verdict (kiln.timing.speedup).
Prints the command, the machine (kiln doctor's CPU line), the versions and every figure;
writes JSON and the result file. The default run (zoo:two-tower: four builds, then the timing)
takes a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

from _results import (  # benchmarks/ is the script's own directory
    Recorder,
    add_arguments,
    speedup_row,
)

import kiln
from kiln.backends import BACKENDS
from kiln.hardware import cpu_info
from kiln.ir import load_model
from kiln.ir.inputs import synthesize
from kiln.timing import interleave, round_stats, speedup

SINGLES = {"ort": {"backend": "ort"}, "openvino": {"backend": "openvino"},
           "auto": {"backend": "auto"}}  # fmt: skip


def machine() -> dict[str, Any]:
    cpu = cpu_info()
    engines = {n: cls().describe() for n, cls in BACKENDS.items() if cls().available()}
    return {
        "cpu": f"{cpu.model} ({cpu.physical_cores} physical, {cpu.logical_cores} logical cores)",
        "python": platform.python_version(),
        "kiln": kiln.__version__,
        "engines": engines,
    }


def build(model: str, where: Path, rounds: int, runs: int) -> tuple[dict[str, Path], dict]:
    """The single-engine artifacts and the partitioned one, and `--partition auto`'s record."""
    paths = {}
    for name, settings in SINGLES.items():
        print(f"building {name} ...", flush=True)
        paths[name] = kiln.compile(model, where / f"{name}.kiln", **settings).path
    print("building --partition auto ...", flush=True)
    auto = kiln.compile(model, where / "partition-auto.kiln", partition="auto", rounds=rounds,
                        runs=runs)  # fmt: skip
    record = dict((auto.manifest.benchmark or {}).get("partition") or {})
    if record.get("choice") == "partitioned":
        paths["partitioned"] = auto.path
    elif record.get("placement"):  # kept one part: the placement it chose, built to measure it
        print(f"building the chosen placement {record['placement']} ...", flush=True)
        placed = kiln.compile(model, where / "partitioned.kiln", partition=record["placement"])
        paths["partitioned"] = placed.path
    return paths, record


def measure(model: str, paths: dict[str, Path], rounds: int, runs: int) -> dict[str, Any]:
    feeds = synthesize(load_model(model).model)
    sessions = {"original": kiln.Session(model)} | {n: kiln.Session(p) for n, p in paths.items()}
    runners = {name: _runner(session, feeds) for name, session in sessions.items()}
    print(f"timing {', '.join(runners)} interleaved, {rounds} rounds × {runs} runs", flush=True)
    samples = interleave(runners, rounds=rounds, runs=runs)
    for session in sessions.values():
        session.close()
    out: dict[str, Any] = {"latency": {n: round_stats(s).to_json() for n, s in samples.items()}}
    if "partitioned" in samples:
        out["partitioned_vs"] = {
            name: speedup(samples[name], samples["partitioned"]).to_json()
            for name in samples
            if name != "partitioned"
        }
    return out


def _runner(session: Any, feeds: dict) -> Any:
    return lambda: session.run(None, feeds)


def report(results: dict[str, Any]) -> None:
    print(f"\ncommand: {results['command']}\nmachine: {results['machine']['cpu']}")
    engines = ", ".join(
        f"{n} {d.get('version', '?')}" for n, d in results["machine"]["engines"].items()
    )
    versions = results["machine"]
    print(f"versions: python {versions['python']}, kiln {versions['kiln']}, {engines}")
    record = results["partition_auto"]
    print(f"\n--partition auto: {record.get('choice')} — {record.get('why')}")
    print(
        f"  placement {record.get('placement')}, threads {record.get('threads')}, "
        f"predicted {record.get('predicted_ms', 0):.2f} ms, measured at compile "
        f"{record.get('measured_ms', 0):.2f} ms, hand-off {record.get('handoff_ms', 0):.3f} ms"
    )
    for part, times in (record.get("part_ms") or {}).items():
        print(f"  part {part}: " + ", ".join(f"{e} {ms:.2f} ms" for e, ms in times.items()))
    print("\nP50 (median of round P50s):")
    for name, stats in results["latency"].items():
        print(f"  {name:12s} {stats['p50_ms']:8.2f} ms  P99 {stats['p99_ms']:8.2f} ms")
    for name, ratio in (results.get("partitioned_vs") or {}).items():
        low, high = ratio["speedup_spread"] or (ratio["speedup"], ratio["speedup"])
        print(f"  partitioned vs {name:10s} {ratio['speedup']:.2f}× ({low:.2f}–{high:.2f}, "
              f"{ratio['verdict']})")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="zoo:two-tower")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--out", default="results/partition.json")
    add_arguments(parser)
    args = parser.parse_args()
    recorder = Recorder("partition")
    results: dict[str, Any] = {"command": " ".join([sys.executable, *sys.argv]),
                               "machine": machine(), "model": args.model}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kiln-partition-") as tmp:
        paths, record = build(args.model, Path(tmp), args.rounds, args.runs)
        results["partition_auto"] = record
        results["auto_choice"] = kiln.Session(paths["auto"]).artifact.manifest.backend.name
        results |= measure(args.model, paths, args.rounds, args.runs)
    report(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {out}")
    recorder.write([
        speedup_row(f"partitioned vs {name}", figures, model=args.model, engine="partitioned",
                    baseline=name)
        for name, figures in results.get("partitioned_vs", {}).items()
    ], results, args.results)  # fmt: skip


if __name__ == "__main__":
    main()
