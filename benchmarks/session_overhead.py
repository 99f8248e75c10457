"""What `kiln.Session.run` costs over `onnxruntime.InferenceSession.run`.

    python benchmarks/session_overhead.py [--models resnet-tiny,bert-tiny] [--rounds 15]
        [--runs 200] [--no-agree] [--out results/session_overhead.json]

Per model: the zoo model written once as model.onnx; a kiln.Session and an
onnxruntime.InferenceSession (CPUExecutionProvider, its defaults) on that same file, fed the
same synthesized inputs, timed in interleaved blocks (`--rounds` blocks of `--runs` runs each,
rotating order, after warm-up: kiln.timing.interleave). Reported: each side's P50 (median of
per-block P50s), the ratio kiln/ort with the range of per-block ratios, and the overhead in
µs. Small models show the overhead best: bert-tiny and resnet-tiny run in tens of µs.

Unless `--no-agree`: the model is also compiled (`kiln.compile`, what `kiln optimize` does)
and `kiln bench ARTIFACT --against ort` run on it (kiln.bench.run_bench), to set the speedup
optimize records beside the one bench measures through Session.run: they should agree within
their spreads. Prints the command, CPU, versions and figures, and writes them as JSON and the
result file. The default run takes a minute or two.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

import onnx
import onnxruntime as ort
from _machine import machine  # benchmarks/ is the script's own directory
from _results import Recorder, add_arguments, row  # benchmarks/ is the script's own directory

import kiln
from kiln import zoo
from kiln.hardware import cpu_info
from kiln.ir.inputs import synthesize
from kiln.timing import interleave, round_p50_ms, speedup, verdict_of


def overhead(model: Path, rounds: int, runs: int) -> dict:
    reference = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    with kiln.Session(str(model)) as session:
        feeds = synthesize(session.interface)
        samples = interleave(
            {
                "ort": lambda: reference.run(None, feeds),
                "kiln": lambda: session.run(None, feeds),
            },
            rounds=rounds,
            runs=runs,
            warmup=50,
        )
    compared = speedup(samples["kiln"], samples["ort"])  # kiln's P50 over ort's
    ort_ms, kiln_ms = round_p50_ms(samples["ort"]), round_p50_ms(samples["kiln"])
    return {
        "inputs": {n: list(a.shape) for n, a in feeds.items()},
        "ort_p50_ms": ort_ms,
        "kiln_p50_ms": kiln_ms,
        "ratio_kiln_over_ort": compared.value,
        "ratio_spread": list(compared.spread) if compared.spread else None,
        "overhead_us": (kiln_ms - ort_ms) * 1e3,
    }


def agreement(name: str, where: Path, rounds: int, runs: int) -> dict:
    """The speedup `kiln optimize` records and the one `kiln bench ARTIFACT` measures."""
    from kiln.bench.report import run_bench

    artifact = kiln.compile(f"zoo:{name}", where / f"{name}.kiln", rounds=rounds, runs=runs)
    recorded = artifact.manifest.benchmark or {}
    bench = run_bench(str(artifact.path), "ort", 1, rounds, runs, lambda _m: None)
    measured = bench["engines"]["kiln"]
    optimize, bench_value = recorded.get("speedup"), measured["speedup_vs_baseline"]
    optimize_spread, bench_spread = recorded.get("speedup_spread"), measured["speedup_spread"]
    return {
        "optimize_speedup": optimize,
        "optimize_spread": optimize_spread,
        "bench_speedup": bench_value,
        "bench_spread": bench_spread,
        # Within noise: each verb's figure inside the other's per-round range.
        "agree": _inside(optimize, bench_spread) and _inside(bench_value, optimize_spread),
    }


def _inside(value: float | None, spread: list[float] | None) -> bool:
    return value is not None and spread is not None and spread[0] <= value <= spread[1]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="resnet-tiny,bert-tiny")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--no-agree", action="store_true", help="skip optimize vs bench")
    parser.add_argument("--out", default="results/session_overhead.json")
    add_arguments(parser)
    args = parser.parse_args()
    recorder = Recorder("session_overhead")
    cpu = cpu_info()
    result: dict = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine(),
        "versions": {
            "kiln": kiln.__version__,
            "onnxruntime": ort.__version__,
            "python": platform.python_version(),
        },  # fmt: skip
        "rounds": args.rounds,
        "runs_per_round": args.runs,
        "models": {},
    }
    print(result["command"])
    print(f"{cpu.model}, {cpu.logical_cores} cores, {platform.platform()}")
    print(f"kiln {kiln.__version__}, onnxruntime {ort.__version__}")
    with tempfile.TemporaryDirectory(prefix="kiln-overhead-") as tmp:
        for name in args.models.split(","):
            path = Path(tmp) / name / "model.onnx"
            path.parent.mkdir()
            onnx.save(zoo.build(name), path)
            figures = overhead(path, args.rounds, args.runs)
            low, high = figures["ratio_spread"] or (float("nan"),) * 2
            print(
                f"{name}: ort P50 {figures['ort_p50_ms'] * 1e3:.1f} µs, kiln.Session P50 "
                f"{figures['kiln_p50_ms'] * 1e3:.1f} µs: kiln/ort "
                f"{figures['ratio_kiln_over_ort']:.3f} ({low:.3f}–{high:.3f}), "
                f"{figures['overhead_us']:+.1f} µs per run"
            )
            if not args.no_agree:
                figures["agreement"] = agreement(name, Path(tmp), args.rounds, args.runs)
                a = figures["agreement"]
                print(
                    f"{name}: kiln optimize {a['optimize_speedup']:.2f}× "
                    f"({a['optimize_spread'][0]:.2f}–{a['optimize_spread'][1]:.2f}), kiln bench "
                    f"{a['bench_speedup']:.2f}× ({a['bench_spread'][0]:.2f}–"
                    f"{a['bench_spread'][1]:.2f}): {'agree' if a['agree'] else 'DISAGREE'} "
                    "within noise"
                )
            result["models"][name] = figures
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    recorder.write(overhead_rows(result["models"]), result, args.results)


def overhead_rows(models: dict) -> list[dict]:
    """Per model: kiln.Session's P50 over onnxruntime's (above 1: Session costs time)."""
    found = []
    for name, figures in models.items():
        spread = figures["ratio_spread"]
        # a latency ratio: every block above 1 means kiln.Session ran slower
        verdict = verdict_of(1 / spread[1], 1 / spread[0]) if spread else "unknown"
        found.append(row(f"{name}: kiln.Session.run P50 ÷ InferenceSession.run P50",
                         figures["ratio_kiln_over_ort"], "x", spread, verdict, model=name,
                         engine="kiln.Session", baseline="onnxruntime",
                         overhead_us=figures["overhead_us"]))  # fmt: skip
    return found


if __name__ == "__main__":
    main()
