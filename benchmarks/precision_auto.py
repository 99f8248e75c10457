"""`kiln optimize --backend auto --precision auto` against each engine's own
lower-precision tools run by hand with their defaults, interleaved in one process.

    python benchmarks/precision_auto.py [--models resnet50,bert-base,unet3d] \
        [--minilm minilm.onnx --minilm-inputs sentences.npz --minilm-calib calib.npz] \
        [--rounds 7] [--runs 10]

For each model: build the auto artifact (every engine × precision verified against the
accuracy budget, fastest kept), then `kiln bench ARTIFACT --against` ORT fp32, ORT int8
(onnxruntime.quantization defaults), OpenVINO fp32 / bf16 / int8 (NNCF defaults). Each row
shows the P50 ratio to ORT fp32 and the worst cosine to the fp32 outputs; a hand-run engine
whose cosine is under 0.99 breaks the default budget Kiln holds itself to. For MiniLM the
real sentences are the timing inputs and the drift reference, and the calibration sentences
calibrate Kiln's and the hand-run engines' int8 alike. The default run (three full-size
models, each built at every engine × precision and benched against five engines) takes
roughly half an hour on 2 cores; `--models resnet50` about a third of that.
"""

from __future__ import annotations

import argparse
import json
import tempfile
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

AGAINST = "ort,ort-int8,openvino,openvino-bf16,openvino-int8"


def against_here() -> str:
    """The engines this CPU runs: OpenVINO bf16 needs bf16 kernels (AMX or AVX512_BF16)."""
    from kiln.backends.openvino import cpu_runs_bf16

    engines = AGAINST.split(",")
    return ",".join(e for e in engines if e != "openvino-bf16" or cpu_runs_bf16())


def auto_artifact(
    model: str, inputs: str | None, calib: str | None, out: Path, rounds: int, say
) -> dict:
    """`kiln optimize MODEL --backend auto --precision auto`, from Python."""
    artifact = kiln.compile(
        model, out, backend="auto", precision="auto", inputs=inputs, calib=calib,
        rounds=rounds, runs=5, progress=say,
    )  # fmt: skip
    return artifact.manifest.benchmark


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="resnet50,bert-base,unet3d")
    parser.add_argument("--minilm", help="all-MiniLM-L6-v2 exported to ONNX (real weights)")
    parser.add_argument("--minilm-inputs", help="real sentences (.npz) for the MiniLM guard")
    parser.add_argument("--minilm-calib", help="other real sentences (.npz) to calibrate on")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--out", default="results/precision_auto.json")
    add_arguments(parser)
    args = parser.parse_args()
    recorder = Recorder("precision_auto")
    console = Console(stderr=True)
    say = lambda msg: console.log(msg)  # noqa: E731
    models = [(f"zoo:{m}", None, None) for m in args.models.split(",") if m]
    if args.minilm:
        models.append((args.minilm, args.minilm_inputs, args.minilm_calib))
    report = {"command": "python benchmarks/precision_auto.py", "models": {}}
    with tempfile.TemporaryDirectory(prefix="kiln-auto-") as tmp:
        for model, inputs, calib in models:
            start = time.time()
            artifact = Path(tmp) / f"{Path(model.replace(':', '_')).stem}.kiln"
            choice = auto_artifact(model, inputs, calib, artifact, 3, say)
            result = run_bench(
                str(artifact),
                against_here(),
                1,
                args.rounds,
                args.runs,
                say,
                inputs=inputs,
                calib=calib,
            )
            print_bench(result, Console())
            Console().print(
                f"auto chose {choice['choice']}, {choice['speedup']:.2f}× "
                f"{choice.get('speedup_spread')} {choice.get('verdict')} (candidates: "
                f"{choice['candidates']}; refused: {choice['refused']}) in "
                f"{time.time() - start:.0f} s"
            )
            report["models"][model] = {"auto": choice, "bench": result}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2, default=float))
    print(f"wrote {args.out}")
    rows = [item for model, found in report["models"].items()
            for item in bench_rows(model, found["bench"])]  # fmt: skip
    recorder.write(rows, report, args.results)


if __name__ == "__main__":
    main()
