"""QAT, structured pruning, distillation and their combination on real,
offline data (scikit-learn's digits, upscaled to 32×32), for the digits CNN and the patch
transformer. Every method ends in a compiled, verified Kiln artifact.

    python benchmarks/compress.py --json results/compress.json [--models cnn,transformer]
        [--cnn-epochs 6] [--transformer-epochs 20] [--rounds 7]

Per model and method: `accuracy` (test split, by the artifact), `p50_ms` (batch 64, every
artifact of a model timed interleaved in the same rounds), `params`, `flops` (kiln.cost, on the
exported ONNX at batch 64), `artifact`. These targets are checked and reported:
QAT int8 ≥ post-training int8 and within 0.5 pt of fp32; 50 % pruned ≤ 1 pt drop and ≥ 1.5×
faster; distilled student ≤ 1.5 pt drop and ≥ 2× faster. The default run is mostly training
(6 CNN epochs and 20 transformer epochs per method on the 1,797 digits): several minutes per
model on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings
from pathlib import Path

from _results import Recorder, add_arguments, row  # benchmarks/ is the script's own directory
from rich.console import Console

from kiln.compress import compress
from kiln.compress.data import digits
from kiln.compress.models import digits_cnn, digits_transformer
from kiln.compress.train import Recipe
from kiln.hardware import cpu_info

MODELS = {"cnn": digits_cnn, "transformer": digits_transformer}
KEYS = ("accuracy", "p50_ms", "params", "flops", "artifact")


def targets(methods: dict) -> dict[str, dict]:
    """Each target: the figure, the bound, met or not."""
    base = methods["fp32"]

    def drop(name: str) -> float:
        return (base["accuracy"] - methods[name]["accuracy"]) * 100

    def speedup(name: str) -> float:
        return base["p50_ms"] / methods[name]["p50_ms"]

    qat_vs_ptq = (methods["qat"]["accuracy"] - methods["int8-ptq"]["accuracy"]) * 100
    return {
        "qat >= ptq int8 (pt)": {"value": qat_vs_ptq, "ok": qat_vs_ptq >= 0},
        "qat drop <= 0.5 pt": {"value": drop("qat"), "ok": drop("qat") <= 0.5},
        "prune drop <= 1 pt": {"value": drop("prune"), "ok": drop("prune") <= 1.0},
        "prune speedup >= 1.5x": {"value": speedup("prune"), "ok": speedup("prune") >= 1.5},
        "distill drop <= 1.5 pt": {"value": drop("distill"), "ok": drop("distill") <= 1.5},
        "distill speedup >= 2x": {"value": speedup("distill"), "ok": speedup("distill") >= 2.0},
        "combined speedup (x)": {"value": speedup("combined"), "ok": True},
        "combined drop (pt)": {"value": drop("combined"), "ok": True},
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", type=Path, default=Path("results/compress.json"))
    parser.add_argument("--models", default="cnn,transformer")
    parser.add_argument("--cnn-epochs", type=int, default=6)
    parser.add_argument("--transformer-epochs", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=7)
    add_arguments(parser)
    args = parser.parse_args()
    recorder = Recorder("compress")
    warnings.simplefilter("ignore")
    console = Console(stderr=True)
    epochs = {"cnn": args.cnn_epochs, "transformer": args.transformer_epochs}
    lrs = {"cnn": 2e-3, "transformer": 1e-3}
    cpu = cpu_info()
    out: dict = {"cpu": f"{cpu.model} ({', '.join(cpu.features)})", "batch": 64, "models": {}}
    artifacts = args.json.parent / "compress"
    data = digits()
    for name in args.models.split(","):
        start = time.monotonic()
        with console.status(f"{name}") as status:
            result = compress(
                MODELS[name], data, method="all", amount=0.5, max_drop=0.01,
                recipe=Recipe(epochs=epochs[name], lr=lrs[name]), workdir=artifacts / name,
                rounds=args.rounds, runs=10,
                progress=lambda msg, n=name: status.update(f"{n}: {msg}"),
            ).to_json()  # fmt: skip
        methods = {m: {k: got[k] for k in KEYS} for m, got in result["methods"].items()}
        out["models"][name] = {
            "methods": methods,
            "targets": targets(methods),
            "prune": result["methods"]["prune"]["detail"],
            "epochs": epochs[name],
            "seconds": time.monotonic() - start,
        }
        for method, got in methods.items():
            console.print(
                f"{name:12s} {method:9s} acc {got['accuracy']:.2%}  p50 {got['p50_ms']:8.2f} ms  "
                f"params {got['params']:>9,}  GFLOP {got['flops'] / 1e9:.3f}", highlight=False,
            )  # fmt: skip
        for target, value in out["models"][name]["targets"].items():
            console.print(
                f"  {target:26s} {value['value']:7.2f}  {'ok' if value['ok'] else 'MISSED'}"
            )
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2, default=float) + "\n")
    recorder.write(compress_rows(out), out, args.results)


def compress_rows(out: dict) -> list[dict]:
    """Each method's accuracy and P50, then each target met or missed."""
    found = []
    for name, figures in out["models"].items():
        for method, measured in figures["methods"].items():
            found.append(row(f"{name} {method}: accuracy", measured["accuracy"], "fraction",
                             model=name, method=method))  # fmt: skip
            found.append(row(f"{name} {method}: P50 at batch 64", measured["p50_ms"], "ms",
                             model=name, method=method))  # fmt: skip
        for target, value in figures["targets"].items():
            found.append(row(f"{name}: {target}", value["value"], "",
                             verdict="met" if value["ok"] else "missed", model=name))  # fmt: skip
    return found


if __name__ == "__main__":
    main()
