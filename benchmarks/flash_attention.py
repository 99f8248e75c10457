"""Long sequences: what ONNX Runtime's flash path gives one Kiln artifact.

    python benchmarks/flash_attention.py ART.kiln --seq 4096 [--rounds 6] [--json F]

ART is an artifact Kiln built for ONNX Runtime at ≥ 1,024 tokens (`kiln optimize
zoo:bert-base-4k`: the zoo compiles it for 4,096; or `benchmarks/long_seq.py --work DIR`),
whose attention `kiln.passes.flash_attention` wrapped in `If` nodes. Two plain ORT sessions,
as Kiln opens the artifact (2 threads, ORT's SkipLayerNormFusion off): the model as built,
and the same model with each `If` replaced by its masked branch — the `Attention` node it
wrapped, so everything else is identical. Inputs: `kiln.ir.inputs.synthesize` at seed 0
(masks of ones: the flash branch runs). One run per engine per round, the order rotating,
`kiln.timing.speedup` over the rounds; cosine between the two outputs. Prints the command,
CPU, versions and every figure; writes JSON and the result file. At 4,096 tokens the default
6 rounds take a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from _machine import machine  # benchmarks/ is the script's own directory
from _results import Recorder, add_arguments, row  # benchmarks/ is the script's own directory

from kiln.hardware import cpu_info
from kiln.ir.inputs import synthesize
from kiln.passes.fused_op_pays import SKIP_LAYERNORM_FUSION
from kiln.timing import interleave, round_p50_ms, speedups
from kiln.verify import cosine


def without_flash(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` with every If that wraps one Attention replaced by that Attention."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    nodes = []
    for node in out.graph.node:
        branch = next((a.g for a in node.attribute if a.name == "else_branch"), None)
        if node.op_type == "If" and branch is not None and len(branch.node) == 1:
            (attention,) = branch.node
            attention.output[0] = node.output[0]
            attention.name = f"{node.name}.attention"
            nodes.append(attention)
        else:
            nodes.append(node)
    del out.graph.node[:]
    out.graph.node.extend(nodes)
    return out


def session(model: onnx.ModelProto, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"],
                                disabled_optimizers=[SKIP_LAYERNORM_FUSION])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--json", type=Path, default=Path("results/flash_attention.json"))
    add_arguments(parser)
    args = parser.parse_args()
    recorder = Recorder("flash_attention")
    command = (f"python benchmarks/flash_attention.py {args.artifact} --seq {args.seq} "
               f"--rounds {args.rounds}")  # fmt: skip
    info = machine()
    print(command)
    print(f"{info['cpu']}, {info['cores']} cores, {' '.join(info['features'])}")
    print(f"onnxruntime {ort.__version__}, onnx {onnx.__version__}, numpy {np.__version__}")
    model = onnx.load(str(args.artifact / "model.onnx"))
    wraps = sum(node.op_type == "If" for node in model.graph.node)
    if not wraps:
        raise SystemExit(f"{args.artifact}: no If nodes: not built with flash-attention")
    threads = max(cpu_info().physical_cores, 1)
    sessions = {"attention": session(without_flash(model), threads),
                "flash": session(model, threads)}  # fmt: skip
    # seed 0: masks of ones, so the flash branch runs
    inputs = synthesize(ir.load(str(args.artifact / "model.onnx")), dims={"seq": args.seq})
    outs = {name: s.run(None, inputs)[0] for name, s in sessions.items()}
    agreement = cosine(outs["attention"], outs["flash"])
    runners = {name: (lambda s=s: s.run(None, inputs)) for name, s in sessions.items()}
    samples = interleave(runners, rounds=args.rounds, runs=1, warmup=0, settle=0)
    ratio = speedups(samples, "attention")["flash"]
    p50 = {name: round_p50_ms(rounds) for name, rounds in samples.items()}
    print(f"{wraps} attention layers wrapped; seq {args.seq}; {threads} threads")
    print(f"  Attention (masked kernel)  P50 {p50['attention']:9.1f} ms")
    print(f"  flash branch               P50 {p50['flash']:9.1f} ms")
    spread = ratio.spread or (ratio.value, ratio.value)
    print(f"  flash × Attention: {ratio.value:.3f} ({spread[0]:.3f}–{spread[1]:.3f}, "
          f"{ratio.verdict}); cosine {agreement:.6f}")  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    result = {"command": command, "machine": info, "seq": args.seq, "layers": wraps,
              "p50_ms": p50, "speedup": ratio.to_json(), "cosine": agreement,
              "rounds_ms": {k: [r[0] * 1e3 for r in v] for k, v in samples.items()}}  # fmt: skip
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    recorder.write([row(
        f"seq {args.seq}: flash branch over the Attention kernel", ratio.value, "x",
        ratio.spread, ratio.verdict, engine="flash", baseline="attention", cosine=agreement,
    )], result, args.results)  # fmt: skip


if __name__ == "__main__":
    main()
