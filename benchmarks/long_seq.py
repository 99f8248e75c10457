"""Long sequences — Kiln's artifacts against ONNX Runtime and OpenVINO as-is.

    python benchmarks/long_seq.py --work /tmp/ls          # the full run: bert-base-4k at 512,
                                                          # 1,024, 2,048, 4,096; gpt2 at 512, 1,024
    python benchmarks/long_seq.py --seqs 256 --gpt2-seqs 128 --rounds 1 --runs 1 --work /tmp/ls

Per model and sequence length S (batch 1, one input set: kiln.ir.inputs.synthesize at seq S,
seed 0, a mask of ones), five engines:

* kiln          Kiln's lossless artifact, `kiln.compile(zoo:NAME, backend="auto",
                precision="fp32", shapes={"seq": (S,)})` (every engine at fp32, OpenVINO also
                static at S, each verified at S, the fastest kept; `--lossless-backend
                ort|openvino` fixes the engine), run as a user runs it (`kiln.Session`);
* kiln-budget   Kiln's budgeted pick, `kiln optimize --backend auto --precision auto` from Python
                (`--budget-precision int8`: the int8 candidates only; every engine × precision
                built, verified within the accuracy budget
                `--max-drop` at S, the fastest kept; it times its candidates `--pick-rounds` ×
                `--pick-runs`);
* ort           ONNX Runtime as-is: ORT_ENABLE_ALL on the original model, fp32 (the baseline);
* openvino      OpenVINO as-is with fp32 forced (INFERENCE_PRECISION_HINT=f32);
* openvino-bf16 OpenVINO at its own default precision on CPUs with bf16 kernels (left out, and
                said so, where the CPU has none: there its default is fp32, the row above).

Timing: `kiln.timing.interleave` in one process, `--rounds` rounds of `--runs` runs per engine in
rotating order after `--warmup` runs (the first also gives each engine's outputs); an engine's
P50 is the median of its per-round P50s, printed with the lowest–highest round P50, and its ×
ORT is the ratio of P50s with the range of per-round ratios (kiln.timing.speedup). Cosine: the
worst per-sample cosine of each output against ORT fp32's (kiln.verify.cosine). Peak memory
(unless `--no-memory`): each engine in a child process of its own (kiln.bench.memory; the peers
open the original .onnx, the Kiln rows their artifact through `kiln.Session`), `load` and `run`
peaks in MiB over the child's baseline, `--memory-runs` runs; `peak` is the larger of the two.

The done-means checks at 4,096 tokens (bert-base-4k): the lossless artifact ≥ 1.3× ORT as-is at
≤ 0.6× its peak memory; the budgeted pick ≥ the best peer. Prints the command, CPU, versions and
every figure, then a Markdown table for the README; writes JSON (`--json`).

Resumable: with `--work DIR` the original models, the artifacts (with the request that built each)
and every finished cell are kept there; a rerun with the same settings reuses them (`--rebuild`
starts over). Memory: all engines stay loaded while one cell is timed, and the budgeted pick
holds every candidate at once while it times them; at 4,096 tokens ORT as-is holds several
B·H·S² score tensors (768 MiB each for bert-base: ≈ 3.5 GiB a layer at its peak), so allow
≈ 10 GiB for the timing and ≈ 16 GiB for the budgeted pick's build (`--no-budget` skips it).
Duration: the default run takes a few hours on 2 cores, most of it the budgeted builds and the
4,096-token cell; `--seqs 256 --gpt2-seqs 128 --rounds 1 --runs 1` takes a few minutes. Writes
`--json` and the result file.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime
import openvino
from _machine import machine  # benchmarks/ is the script's own directory
from _results import Recorder, add_arguments, speedup_row

import kiln
from kiln import zoo
from kiln.artifact import read_artifact
from kiln.bench.engines import engine_runner
from kiln.bench.memory import engine_memory
from kiln.hardware import cpu_info
from kiln.ir.inputs import synthesize
from kiln.ir.load import graphs
from kiln.runtime import Session
from kiln.timing import interleave, round_stats, speedups
from kiln.verify import cosine

BERT, GPT2 = "bert-base-4k", "gpt2"
KILN, BUDGET, ORT = "kiln", "kiln-budget", "ort"
DONE_SEQ = 4096
DONE_SPEEDUP, DONE_MEMORY = 1.3, 0.6


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seqs", default="512,1024,2048,4096", help="bert-base-4k lengths")
    parser.add_argument("--gpt2-seqs", default="512,1024", help="gpt2 lengths ('' for none)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds")
    parser.add_argument("--runs", type=int, default=3, help="runs per engine per round")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs per engine (≥ 1)")
    parser.add_argument("--peers", default="openvino,openvino-bf16",
                        help="engines beside ORT as-is (kiln.bench.engines names)")  # fmt: skip
    parser.add_argument("--lossless-backend", default="auto", choices=("ort", "openvino", "auto"),
                        help="the lossless (fp32) artifact's engine (auto: faster)")  # fmt: skip
    parser.add_argument("--lossless-partition", default="none", choices=("none", "auto"),
                        help="auto: the lossless artifact may run the layers' stretches on "
                        "different engines (kept only when faster than one engine)")  # fmt: skip
    parser.add_argument("--max-drop", type=float, default=0.01,
                        help="the budgeted pick's accuracy budget (cosine, relative)")  # fmt: skip
    parser.add_argument("--pick-rounds", type=int, default=3,
                        help="rounds the budgeted pick times its candidates over")  # fmt: skip
    parser.add_argument("--pick-runs", type=int, default=2, help="... and runs per round")
    parser.add_argument("--budget-precision", default="auto",
                        help="the budgeted pick's --precision (auto: every one; e.g. int8 where "
                        "holding every candidate does not fit in memory)")  # fmt: skip
    parser.add_argument("--no-budget", action="store_true", help="leave the budgeted pick out")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory children")
    parser.add_argument("--memory-runs", type=int, default=2, help="runs in each memory child")
    parser.add_argument("--work", help="keep originals, artifacts and finished cells here")
    parser.add_argument("--rebuild", action="store_true", help="ignore what --work holds")
    parser.add_argument("--json", default="results/long_seq.json", help="where to write JSON")
    add_arguments(parser)
    args = parser.parse_args()
    args.seqs = _ints(args.seqs)
    args.gpt2_seqs = _ints(args.gpt2_seqs)
    args.peers = [p for p in args.peers.split(",") if p]
    if min(args.rounds, args.runs, args.warmup, args.memory_runs) < 1:
        parser.error("--rounds, --runs, --warmup and --memory-runs must be ≥ 1")
    limits = {BERT: zoo.bert.LONG.max_positions, GPT2: zoo.gpt2.FULL.positions}
    for name, seqs in ((BERT, args.seqs), (GPT2, args.gpt2_seqs)):
        if any(s < 1 or s > limits[name] for s in seqs):
            parser.error(f"{name} takes 1 to {limits[name]} tokens; got {seqs}")
    return args


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def header(args: argparse.Namespace) -> dict:
    cpu = cpu_info()
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine(),
        "versions": {
            "kiln": kiln.__version__,
            "onnxruntime": onnxruntime.__version__,
            "openvino": openvino.__version__,
            "onnx": onnx.__version__,
            "numpy": np.__version__,
            "python": platform.python_version(),
        },  # fmt: skip
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "work", "results")},
    }
    print(result["command"])
    print(f"{cpu.model}, {cpu.logical_cores} cores, {' '.join(cpu.features)}, "
          f"{platform.platform()}")  # fmt: skip
    print(", ".join(f"{k} {v}" for k, v in result["versions"].items()), flush=True)
    return result


def peers_here(peers: list[str]) -> tuple[list[str], dict[str, str]]:
    """The peers this CPU runs, and why any is left out (OpenVINO bf16 needs bf16 kernels)."""
    from kiln.backends.openvino import cpu_runs_bf16

    kept, left = [], {}
    for name in peers:
        if name == ORT:
            continue  # always there: the baseline
        if name == "openvino-bf16" and not cpu_runs_bf16():
            left[name] = "no bf16 kernels on this CPU: OpenVINO's default here is fp32"
        else:
            kept.append(name)
    return kept, left


# ---------------------------------------------------------------------------------- building


def original_file(name: str, work: Path) -> Path:
    """The zoo model as a user's file (weights beside it), written once per work directory."""
    path = work / f"{name}.onnx"
    if not path.is_file():
        onnx.save(zoo.build(name), str(path), save_as_external_data=True,
                  location=f"{name}.onnx.data")  # fmt: skip
    return path


def artifact(name: str, seq: int, kind: str, work: Path, args: argparse.Namespace) -> dict:
    """Kiln's artifact of `kind` (KILN: lossless; BUDGET: the budgeted pick) for seq `seq`,
    reused from `work` when the same request built it there."""
    path = work / f"{name}-s{seq}-{kind}.kiln"
    request: dict[str, Any] = {"model": f"zoo:{name}", "shapes": {"seq": [seq]},
                               "kiln": kiln.__version__}  # fmt: skip
    if kind == BUDGET:
        request |= {"backend": "auto", "precision": args.budget_precision,
                    "max_drop": args.max_drop}  # fmt: skip
    elif args.lossless_backend != "ort":
        request |= {"backend": args.lossless_backend, "precision": "fp32"}
    if kind == KILN and args.lossless_partition != "none":
        request |= {"partition": args.lossless_partition, "precision": "fp32",
                    "rounds": args.pick_rounds, "runs": args.pick_runs}  # fmt: skip
    if request.get("backend") == "auto":  # auto picks by timing its candidates
        request |= {"rounds": args.pick_rounds, "runs": args.pick_runs}
    record = work / f"{path.name}.request.json"
    if not args.rebuild and record.is_file() and json.loads(record.read_text()) == request:
        try:
            built = read_artifact(path)
            print(f"  reusing {path}", flush=True)
            return _described(built, json.loads(record.read_text()), None)
        except kiln.KilnError as exc:
            print(f"  rebuilding {path}: {exc}", flush=True)
    record.unlink(missing_ok=True)
    start = time.perf_counter()
    extra = {k: v for k, v in request.items() if k not in ("model", "shapes", "kiln")}
    built = kiln.compile(request["model"], path, shapes={"seq": (seq,)}, force=True,
                         progress=_progress(f"  {kind}: "), **extra)  # fmt: skip
    seconds = time.perf_counter() - start
    record.write_text(json.dumps(request) + "\n")
    print(f"  built {path.name} in {seconds:.0f} s", flush=True)
    return _described(built, request, seconds)


def _progress(prefix: str) -> Any:
    """Print each new step of a compile once (a long build says what it is doing)."""
    said: list[str] = []

    def say(message: str) -> None:
        if not said or said[-1] != message:
            said.append(message)
            print(f"{prefix}{message}", flush=True)

    return say


def _described(built: Any, request: dict, seconds: float | None) -> dict:
    manifest = built.manifest
    benchmark = manifest.benchmark or {}
    return {
        "path": str(built.path),
        "request": request,
        "build_s": seconds,
        "engine": manifest.backend.name,
        "precision": manifest.precision.get("default", "fp32"),
        "fused_ops": fused_ops(built.path),
        "verification": manifest.verification.summary() if manifest.verification else None,
        "pick": {k: benchmark[k] for k in ("choice", "candidates") if k in benchmark},
    }


def fused_ops(artifact_path: Path) -> dict[str, int]:
    """How many of each non-default-domain op the artifact holds (com.microsoft Attention...),
    If branches and every part of a partitioned one included: each long-sequence Attention
    sits in an If beside its flash form."""
    files = [artifact_path / "model.onnx"]
    if not files[0].is_file():  # partitioned: parts/NAME.kiln/model.onnx
        files = sorted(artifact_path.glob("parts/*.kiln/model.onnx"))
    counts: dict[str, int] = {}
    for model in (onnx.load(str(f), load_external_data=False) for f in files):
        for node in (n for g in graphs(model.graph) for n in g.node):
            if node.domain not in ("", "ai.onnx"):
                key = f"{node.domain}:{node.op_type}"
                counts[key] = counts.get(key, 0) + 1
    return dict(sorted(counts.items()))


# ---------------------------------------------------------------------------------- one cell


def cell(name: str, seq: int, work: Path, args: argparse.Namespace, peers: list[str]) -> dict:
    """Build, time, compare and measure every engine on `name` at `seq` tokens."""
    print(f"\n== {name}, seq {seq}, batch 1", flush=True)
    source = original_file(name, work)
    builds = {KILN: artifact(name, seq, KILN, work, args)}
    if not args.no_budget:
        builds[BUDGET] = artifact(name, seq, BUDGET, work, args)
    feeds = synthesize(ir.from_proto(onnx.load(str(source), load_external_data=False)),
                       {"batch": 1, "seq": seq}, seed=0)  # fmt: skip
    sessions = {kind: Session(b["path"]) for kind, b in builds.items()}
    runners = {ORT: engine_runner(ORT, str(source), feeds)}
    runners |= {p: engine_runner(p, str(source), feeds) for p in peers}
    runners |= {kind: _runner(session, feeds) for kind, session in sessions.items()}
    print(f"  first run of {', '.join(runners)}", flush=True)
    outputs = {engine: run() for engine, run in runners.items()}  # the first warm-up run
    cosines = {engine: worst_cosine(outputs[ORT], out) for engine, out in outputs.items()}
    del outputs
    print(f"  timing: {args.rounds} rounds × {args.runs} runs", flush=True)
    samples = interleave_rounds(runners, args)
    for session in sessions.values():
        session.close()
    del runners, sessions
    gc.collect()  # the engines' arenas go before the memory children start
    ratios = speedups(samples, ORT)
    engines = {}
    for engine, rounds in samples.items():
        per_round = [float(np.median(r)) * 1e3 for r in rounds]
        engines[engine] = {
            **round_stats(rounds).to_json(),
            "round_p50_ms": per_round,
            **ratios[engine].to_json(),
            "cosine": cosines[engine],
        }  # fmt: skip
    if not args.no_memory:
        for engine, figures in memory(source, feeds, builds, peers, args).items():
            engines[engine]["memory"] = figures
    return {"model": name, "seq": seq, "builds": builds, "engines": engines,
            "precision": precisions(builds, peers)}  # fmt: skip


def _runner(session: Session, feeds: dict) -> Any:
    return lambda: session.run(None, feeds)


def interleave_rounds(runners: dict, args: argparse.Namespace) -> dict[str, list[list[float]]]:
    def said(done: int) -> None:
        print(f"  round {done}/{args.rounds}", flush=True)

    return interleave(runners, rounds=args.rounds, runs=args.runs, warmup=args.warmup - 1,
                      on_round=said)  # fmt: skip


def worst_cosine(reference: list, outputs: list) -> float:
    """The worst per-sample cosine over the floating outputs (kiln.verify.cosine)."""
    scores = [cosine(r, o) for r, o in zip(reference, outputs, strict=True)
              if np.issubdtype(r.dtype, np.floating) and r.shape == o.shape]  # fmt: skip
    return min(scores, default=float("nan"))


def memory(source: Path, feeds: dict, builds: dict, peers: list[str],
           args: argparse.Namespace) -> dict[str, dict]:  # fmt: skip
    """Each engine's resident memory, in a child process of its own (kiln.bench.memory)."""
    print("  peak memory, one child per engine", flush=True)
    said = lambda engine: print(f"    {engine}", flush=True)  # noqa: E731
    found = engine_memory([ORT, *peers], source, feeds, artifact=builds[KILN]["path"],
                          runs=args.memory_runs, on_engine=said)  # fmt: skip
    if BUDGET in builds:
        said(BUDGET)
        found[BUDGET] = engine_memory([], source, feeds, artifact=builds[BUDGET]["path"],
                                      runs=args.memory_runs)[KILN]  # fmt: skip
    for figures in found.values():
        peak = figures["peak_rss_mib"]
        figures["peak_mib"] = max(peak["load"], peak["run"])
    return found


# How each peer runs, where its name alone does not say it (kiln.bench.engines).
PEER_RUNS_AS = {
    "openvino-bf16": "openvino bf16",
    "ort-int8": "ort int8 (quantize_dynamic)",
    "openvino-int8": "openvino int8 (NNCF)",
}


def precisions(builds: dict, peers: list[str]) -> dict[str, str]:
    out = {ORT: "ort fp32"}
    out |= {p: PEER_RUNS_AS.get(p, f"{p} fp32") for p in peers}
    # the pick's own label where auto chose ("openvino/fp32 static"), else engine and precision
    out |= {kind: (b["pick"].get("choice") or f"{b['engine']}/{b['precision']}").replace("/", " ")
            for kind, b in builds.items()}  # fmt: skip
    return out


# ---------------------------------------------------------------------------------- printing


def print_cell(result: dict) -> None:
    for kind, b in result["builds"].items():
        fused = ", ".join(f"{n} {op}" for op, n in b["fused_ops"].items()) or "none"
        pick = f"; picked {b['pick']['choice']}" if b["pick"].get("choice") else ""
        print(f"  {kind}: {b['engine']} {b['precision']}{pick}; fused ops: {fused}; "
              f"verified: {b['verification']}")  # fmt: skip
    print(f"  {'engine':13} {'runs as':28} {'P50 ms':>10} {'(rounds)':>21} {'× ORT':>7} "
          f"{'(rounds)':>15} {'load MiB':>9} {'run MiB':>9} {'cosine':>9}")  # fmt: skip
    for engine, e in result["engines"].items():
        low, high = min(e["round_p50_ms"]), max(e["round_p50_ms"])
        spread = e["speedup_spread"]
        ratio = f"{spread[0]:.2f}–{spread[1]:.2f}" if spread else "–"
        mem = e.get("memory", {}).get("peak_rss_mib")
        load, run = (f"{mem['load']:9.0f}", f"{mem['run']:9.0f}") if mem else ("–", "–")
        print(f"  {engine:13} {result['precision'][engine]:28} {e['p50_ms']:10.1f} "
              f"({low:9.1f}–{high:9.1f}) {e['speedup']:6.2f}× ({ratio:>13}) {load:>9} {run:>9} "
              f"{e['cosine']:9.6f}", flush=True)  # fmt: skip


def checks(cells: list[dict], peers: list[str]) -> dict:
    """The done-means checks at 4,096 tokens (or, said so, at the longest bert seq run)."""
    bert = [c for c in cells if c["model"] == BERT]
    if not bert:
        return {}
    at = next((c for c in bert if c["seq"] == DONE_SEQ), max(bert, key=lambda c: c["seq"]))
    engines = at["engines"]
    kiln_, ort_ = engines[KILN], engines[ORT]
    out: dict[str, Any] = {"seq": at["seq"], "done_means_seq": DONE_SEQ,
                           "kiln_speedup": kiln_["speedup"],
                           "kiln_speedup_ok": kiln_["speedup"] >= DONE_SPEEDUP}  # fmt: skip
    if "memory" in kiln_ and "memory" in ort_:
        share = kiln_["memory"]["peak_mib"] / max(ort_["memory"]["peak_mib"], 1e-9)
        out |= {"kiln_memory_share": share, "kiln_memory_ok": share <= DONE_MEMORY}
    if BUDGET in engines:
        best = max([ORT, *peers], key=lambda p: engines[p]["speedup"])
        out |= {"best_peer": best, "best_peer_speedup": engines[best]["speedup"],
                "budget_speedup": engines[BUDGET]["speedup"],
                "budget_ok": engines[BUDGET]["speedup"] >= engines[best]["speedup"]}  # fmt: skip
    return out


def print_checks(found: dict) -> None:
    if not found:
        return
    final = found["seq"] == found["done_means_seq"]
    where = f"seq {found['seq']}"
    if not final:
        where += f" (the done-means are at {found['done_means_seq']}: figures only, no verdict)"

    def verdict(ok: bool) -> str:
        return ("PASS" if ok else "FAIL") if final else ""

    print(f"\ndone-means at {where}:")
    print(f"  lossless ≥ {DONE_SPEEDUP}× ORT as-is: {found['kiln_speedup']:.2f}× "
          f"{verdict(found['kiln_speedup_ok'])}")  # fmt: skip
    if "kiln_memory_share" in found:
        print(f"  lossless peak memory ≤ {DONE_MEMORY}× ORT's: {found['kiln_memory_share']:.2f}× "
              f"{verdict(found['kiln_memory_ok'])}")  # fmt: skip
    if "budget_ok" in found:
        print(f"  budgeted ≥ best peer ({found['best_peer']} {found['best_peer_speedup']:.2f}×):"
              f" {found['budget_speedup']:.2f}× {verdict(found['budget_ok'])}")  # fmt: skip


def markdown(cells: list[dict]) -> str:
    """The README table: one row per model × seq × engine."""
    lines = ["| model | seq | engine | runs as | P50 ms | × ORT (rounds) | peak MiB | cosine |",
             "|---|---:|---|---|---:|---|---:|---:|"]  # fmt: skip
    for c in cells:
        for engine, e in c["engines"].items():
            spread = e["speedup_spread"]
            ratio = f"{e['speedup']:.2f}×" + (
                f" ({spread[0]:.2f}–{spread[1]:.2f})" if spread else ""
            )
            peak = e.get("memory", {}).get("peak_mib")
            peak_text = "–" if peak is None else f"{peak:,.0f}"
            cells_ = [c["model"], f"{c['seq']:,}", engine, c["precision"][engine],
                      f"{e['p50_ms']:,.0f}", ratio, peak_text, f"{e['cosine']:.5f}"]  # fmt: skip
            lines.append("| " + " | ".join(cells_) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- main


def workdir(given: str | None):
    if given is None:
        return tempfile.TemporaryDirectory(prefix="kiln-long-seq-")
    Path(given).mkdir(parents=True, exist_ok=True)
    return nullcontext(given)


def main() -> None:
    args = parse()
    recorder = Recorder("long_seq")
    result = header(args)
    peers, left_out = peers_here(args.peers)
    for peer, why in left_out.items():
        print(f"{peer} left out: {why}", flush=True)
    result["left_out"] = left_out
    plan = [(BERT, s) for s in args.seqs] + [(GPT2, s) for s in args.gpt2_seqs]
    # what a kept cell must have been measured with to be reused
    settings = {k: v for k, v in result["settings"].items() if k not in ("seqs", "gpt2_seqs")}
    settings |= {"peers": peers, "rebuild": False}
    cells = []
    with workdir(args.work) as where:
        work = Path(where)
        for name, seq in plan:
            done = work / f"cell-{name}-s{seq}.json"
            if not args.rebuild and done.is_file():
                kept = json.loads(done.read_text())
                if kept.get("settings") == settings and kept.get("kiln") == kiln.__version__:
                    print(f"\n== {name}, seq {seq}: reusing {done}", flush=True)
                    kept["precision"] |= {p: PEER_RUNS_AS[p] for p in peers if p in PEER_RUNS_AS}
                    cells.append(kept)
                    print_cell(kept)
                    continue
            start = time.perf_counter()
            found = cell(name, seq, work, args, peers)
            found |= {"settings": settings, "kiln": kiln.__version__,
                      "seconds": time.perf_counter() - start}  # fmt: skip
            done.write_text(json.dumps(found, indent=2) + "\n")
            cells.append(found)
            print_cell(found)
    result["cells"] = cells
    result["checks"] = checks(cells, peers)
    print_checks(result["checks"])
    result["markdown"] = markdown(cells)
    print("\n" + result["markdown"])
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    recorder.write(cell_rows(cells), result, args.results)


def cell_rows(cells: list[dict]) -> list[dict]:
    """Every engine's P50 over ONNX Runtime as-is at each model and length, its spread and
    verdict, with its worst cosine and (when measured) its peak memory."""
    found = []
    for item in cells:
        for engine, figures in item["engines"].items():
            if engine == ORT:
                continue
            label = f"{item['model']}, seq {item['seq']}: {engine} vs {ORT}"
            peak = (figures.get("memory") or {}).get("peak_mib")
            found.append(speedup_row(label, figures, model=item["model"], engine=engine,
                                     baseline=ORT, seq=item["seq"], cosine=figures["cosine"],
                                     peak_mib=peak))  # fmt: skip
    return found


if __name__ == "__main__":
    main()
