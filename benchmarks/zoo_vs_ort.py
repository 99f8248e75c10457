"""Zoo models compiled by Kiln (verified) and timed against ONNX Runtime as-is, interleaved.

    python benchmarks/zoo_vs_ort.py [--models resnet-tiny,bert-tiny] [--precision fp32|int8] \
        [--rounds 7] [--runs 10] [--out results/zoo_vs_ort.json]

The default run takes the tiny zoo models: about a minute on 2 cores, at fp32 or at
`--precision int8` (each result file's `seconds` says how long its run took). The full-size ones
(`--models bert-base,gpt2,vit-b16,resnet50,mobilenetv2,unet3d`) take several minutes each.
Transformers are also timed against ONNX Runtime's offline transformers optimizer; at
`--precision int8` Kiln's int8 artifact meets ONNX Runtime's own int8 quantizer too. Every
figure is a ratio of P50s (each the median of per-round P50s) with the range of per-round
ratios and a verdict (kiln.timing.speedup); the result file has every engine's statistics.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from _results import (  # benchmarks/ is the script's own directory
    Recorder,
    add_arguments,
    bench_rows,
)
from rich.console import Console

import kiln
from kiln.bench.report import run_bench
from kiln.report.terminal import print_bench

TRANSFORMER_PEERS = "ort,ort-transformers,ort-basic"
CONV_PEERS = "ort,ort-basic"
TRANSFORMERS = ("bert", "gpt2", "vit")
TINY = "resnet-tiny,mobilenetv2-tiny,bert-tiny,gpt2-tiny,vit-tiny"


def peers(name: str, precision: str) -> str:
    """The engines a model meets: ONNX Runtime first (the baseline every ratio is over)."""
    chosen = TRANSFORMER_PEERS if name.startswith(TRANSFORMERS) else CONV_PEERS
    return chosen + (",ort-int8" if precision == "int8" else "")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--out", default="results/zoo_vs_ort.json")
    parser.add_argument("--models", default=TINY)
    parser.add_argument("--precision", choices=("fp32", "int8"), default="fp32")
    add_arguments(parser)
    args = parser.parse_args()
    recorder = Recorder("zoo_vs_ort")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    console = Console()
    console.print(f"[dim]{' '.join(sys.argv)}[/dim]")
    results, rows = {}, []
    for name in args.models.split(","):
        start = time.perf_counter()
        artifact = kiln.compile(
            f"zoo:{name}", out.parent / f"{name}-{args.precision}.kiln", precision=args.precision
        )
        compile_s = time.perf_counter() - start
        verification = artifact.manifest.verification.to_json()
        result = run_bench(
            str(artifact.path),
            peers(name, args.precision),
            1,
            args.rounds,
            args.runs,
            lambda _m: None,
            command=" ".join(sys.argv),
        )
        result["compile_seconds"] = compile_s
        result["verification"] = verification
        result["passes"] = [dataclasses.asdict(p) for p in artifact.manifest.passes]
        results[name] = result
        rows += bench_rows(name, result)
        print_bench(result, console)
        console.print(f"{name}: verified={verification['ok']}, compile {compile_s:.0f} s")
        out.write_text(json.dumps(results, indent=2) + "\n")
    console.print(f"wrote {out}")
    recorder.write(rows, results, args.results, tag="" if args.precision == "fp32" else "int8")


if __name__ == "__main__":
    main()
