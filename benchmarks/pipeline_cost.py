"""Which part of Kiln's pipeline costs ONNX Runtime time? Raw ORT sessions, interleaved.

    python benchmarks/pipeline_cost.py [--model zoo:bert-base] [--rounds 9] [--runs 10] \
        [--json results/pipeline_cost.json]

Each variant is a `kiln.compile(MODEL, pipeline=..., rounds=0)` artifact (or the original), its
model.onnx opened in a plain `onnxruntime.InferenceSession` at ORT_ENABLE_ALL (no Kiln runtime
in the way: no spinning policy, no input checks), timed interleaved with the original as ORT
opens it as-is; the ratio is the original's P50 over the variant's, with the per-round range:

* original                   the model as loaded, saved with `onnx_ir.save` (the baseline)
* original+shapes            the same after `onnx.shape_inference` (value_info written)
* cleanup                    Kiln's `cleanup` pass alone (simplify + shape inference)
* cleanup-no-value-info      that artifact with its value_info removed
* simplify-stage             every pass of the default pipeline outside the fuse stage
* full                       the default pipeline (what `kiln optimize` writes)
* full-no-value-info         that artifact with its value_info removed

It asks where a default artifact slower than ONNX Runtime as-is loses its time. The default
run (zoo:bert-base: six compiles, then 9 rounds × 10 runs of seven sessions) takes a few
minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
from collections.abc import Callable
from pathlib import Path

import onnx
import onnx_ir as ir
import onnxruntime as ort
from _machine import machine  # benchmarks/ is the script's own directory
from _results import (  # benchmarks/ is the script's own directory
    Recorder,
    add_arguments,
    speedup_row,
)

import kiln
from kiln.compiler.candidate import resolve_pipeline
from kiln.hardware import cpu_info
from kiln.ir.inputs import synthesize
from kiln.ir.load import load_model
from kiln.timing import interleave, round_stats, speedups


def _without_value_info(path: Path, out: Path) -> Path:
    proto = onnx.load(str(path))  # external weights read in: the copy is self-contained
    del proto.graph.value_info[:]
    onnx.save(proto, str(out))
    return out


def _variants(source: str, work: Path) -> dict[str, Path]:
    model = load_model(source).model
    ir.save(model, work / "original.onnx")
    shaped = onnx.shape_inference.infer_shapes(onnx.load(str(work / "original.onnx")))
    onnx.save(shaped, str(work / "original-shapes.onnx"))
    simplify_stage = [s.name for s in resolve_pipeline(None, "ort") if s.stage != "fuse"]

    def artifact(name: str, pipeline: list[str] | None) -> Path:
        built = kiln.compile(source, work / f"{name}.kiln", pipeline=pipeline, rounds=0)
        return Path(built.path) / "model.onnx"

    cleanup, full = artifact("cleanup", ["cleanup"]), artifact("full", None)
    return {
        "original": work / "original.onnx",
        "original+shapes": work / "original-shapes.onnx",
        "cleanup": cleanup,
        "cleanup-no-value-info": _without_value_info(cleanup, work / "cleanup-nvi.onnx"),
        "simplify-stage": artifact("simplify-stage", simplify_stage),
        "full": full,
        "full-no-value-info": _without_value_info(full, work / "full-nvi.onnx"),
    }


def _runner(session: ort.InferenceSession, feeds: dict) -> Callable[[], object]:
    return lambda: session.run(None, feeds)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="zoo:bert-base")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--json", type=Path, default=None)
    add_arguments(parser)
    args = parser.parse_args()
    recorder = Recorder("pipeline_cost")
    cpu = cpu_info()
    print(f"python benchmarks/pipeline_cost.py --model {args.model} --rounds {args.rounds} "
          f"--runs {args.runs}")  # fmt: skip
    versions = f"onnxruntime {ort.__version__}, kiln {kiln.__version__}"
    print(f"{cpu.model}, {cpu.physical_cores} cores, {' '.join(cpu.features)}; {versions}")
    print(platform.platform())
    work = Path(tempfile.mkdtemp(prefix="pipeline-cost-"))
    paths = _variants(args.model, work)
    feeds = synthesize(load_model(args.model).model)
    sessions = {
        name: ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        for name, path in paths.items()
    }
    runners = {name: _runner(session, feeds) for name, session in sessions.items()}
    samples = interleave(runners, rounds=args.rounds, runs=args.runs)
    ratios = speedups(samples, "original")
    rows = {}
    for name in runners:
        ratio = ratios[name].to_json()
        rows[name] = {"p50_ms": round_stats(samples[name]).p50_ms, **ratio}
        low, high = ratio["speedup_spread"]
        print(f"{name:<24} P50 {rows[name]['p50_ms']:8.2f} ms  × original "
              f"{ratio['speedup']:.3f} ({low:.3f}–{high:.3f})  {ratio['verdict']}")  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"machine": machine(), "variants": rows}, indent=1))
        print(f"wrote {args.json}")
    recorder.write([
        speedup_row(f"{name} vs original", figures, model=args.model, engine=name,
                    baseline="original", p50_ms=figures["p50_ms"])
        for name, figures in rows.items() if name != "original"
    ], {"variants": rows}, args.results)  # fmt: skip


if __name__ == "__main__":
    main()
