"""Issue-2 benchmark: every full-size zoo model compiled (fp32, verified) and timed against
ONNX Runtime as-is, interleaved in one process.

    python benchmarks/zoo_vs_ort.py [--rounds 7] [--runs 10] [--out results/zoo_vs_ort.json]

Transformers are also timed against ONNX Runtime's offline transformers optimizer. Every
figure is a ratio of P50s (each the median of per-round P50s) with the range of per-round
ratios and a verdict (kiln.timing.speedup); the JSON has all the per-engine statistics.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from rich.console import Console

import kiln
from kiln.bench.report import run_bench
from kiln.report.terminal import print_bench

MODELS = {
    "bert-base": "ort,ort-transformers,ort-basic",
    "gpt2": "ort,ort-transformers,ort-basic",
    "vit-b16": "ort,ort-transformers,ort-basic",
    "resnet50": "ort,ort-basic",
    "mobilenetv2": "ort,ort-basic",
    "unet3d": "ort,ort-basic",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--out", default="results/zoo_vs_ort.json")
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    console = Console()
    console.print(f"[dim]{' '.join(sys.argv)}[/dim]")
    results = {}
    for name in args.models.split(","):
        start = time.perf_counter()
        artifact = kiln.compile(f"zoo:{name}", out.parent / f"{name}.kiln")
        compile_s = time.perf_counter() - start
        verification = artifact.manifest.verification.to_json()
        result = run_bench(
            str(artifact.path),
            MODELS[name],
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
        print_bench(result, console)
        worst = max(o["max_abs"] / o["bound"] for o in verification["outputs"])
        console.print(
            f"{name}: verified={verification['ok']} (worst error {worst:.1%} of the bound), "
            f"compile {compile_s:.0f} s"
        )
        out.write_text(json.dumps(results, indent=2) + "\n")
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
