"""The floor for bert-base: its twelve layers' GEMMs and nothing else, in an engine.

    python benchmarks/bert_gemm_floor.py [--seq 128] [--runs 40]
    python benchmarks/bert_gemm_floor.py --engine openvino --precision int8 \
        [--rounds 10] [--runs 20] [--json results/bert_gemm_floor.json]

If the whole model already runs in about this time, no graph rewrite that keeps the FLOPs and
the precision can make it much faster: only fewer FLOPs or lower precision can.

fp32 (ONNX Runtime): the GEMM stack alone. int8 (OpenVINO): the stack quantized by NNCF with
the TRANSFORMER preset, interleaved (`--rounds` blocks of `--runs`) with zoo bert-base under
the hand recipe a user runs (`nncf.quantize`, `ModelType.TRANSFORMER`, OpenVINO's defaults):
how much of the recipe's time is the int8 GEMMs themselves, and their rate against `kiln
doctor`'s measured int8 peak. Prints the command, CPU, versions and figures; writes JSON and
the result file. fp32 takes about half a minute; int8 (NNCF on bert-base) a few minutes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from _machine import machine  # benchmarks/ is the script's own directory
from _results import Recorder, add_arguments, row  # benchmarks/ is the script's own directory
from onnx import TensorProto
from onnx import helper as h
from onnx import numpy_helper as nh

HIDDEN, FFN, LAYERS = 768, 3072, 12
CALIBRATION = 16  # samples, as the recipe's


def gemm_stack(seq: int) -> bytes:
    rng = np.random.default_rng(0)
    inits, nodes, x = [], [], "x"
    for layer in range(LAYERS):
        shapes = [(HIDDEN, HIDDEN)] * 4 + [(HIDDEN, FFN), (FFN, HIDDEN)]
        for j, shape in enumerate(shapes):
            name = f"w{layer}_{j}"
            inits.append(nh.from_array((rng.standard_normal(shape) * 0.02).astype("f4"), name))
            source = f"y{layer}_4" if j == 5 else x
            nodes.append(h.make_node("MatMul", [source, name], [f"y{layer}_{j}"]))
        # Every product feeds the next layer: an engine drops a MatMul whose output is unused.
        summed = [f"y{layer}_{j}" for j in (0, 1, 2, 3, 5)]
        nodes.append(h.make_node("Sum", summed, [f"x{layer}"]))
        x = f"x{layer}"
    graph = h.make_graph(
        nodes,
        "gemms",
        [h.make_tensor_value_info("x", TensorProto.FLOAT, [1, seq, HIDDEN])],
        [h.make_tensor_value_info(x, TensorProto.FLOAT, [1, seq, HIDDEN])],
        inits,
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]).SerializeToString()


def gemm_flops(seq: int) -> int:
    return LAYERS * 2 * seq * (4 * HIDDEN * HIDDEN + 2 * HIDDEN * FFN)


def ort_fp32(seq: int, runs: int) -> dict:
    session = ort.InferenceSession(gemm_stack(seq), providers=["CPUExecutionProvider"])
    feed = {"x": np.random.default_rng(1).standard_normal((1, seq, HIDDEN)).astype("f4")}
    for _ in range(5):
        session.run(None, feed)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        session.run(None, feed)
        times.append(time.perf_counter() - start)
    p50 = statistics.median(times)
    rate = gemm_flops(seq) / p50 / 1e9
    print(
        f"bert-base GEMMs only, seq {seq}: P50 {p50 * 1e3:.1f} ms, {gemm_flops(seq) / 1e9:.1f} "
        f"GFLOP, {rate:.0f} GFLOP/s (onnxruntime {ort.__version__})"
    )
    return {"engine": "ort", "precision": "fp32", "gemms_p50_ms": p50 * 1e3, "gflops": rate}


def openvino_int8(seq: int, rounds: int, runs: int) -> dict:
    """The NNCF int8 GEMM stack and the NNCF TRANSFORMER recipe on bert-base, interleaved."""
    import openvino as ov

    from kiln import zoo
    from kiln.backends import OpenVinoOptions, get_backend
    from kiln.backends.openvino_quant import quantize_nncf_int8
    from kiln.hardware import measured_peaks
    from kiln.ir.inputs import synthesize
    from kiln.timing import interleave, round_p50_ms, speedup

    rng = np.random.default_rng(1)
    stack = ir.serde.deserialize_model(onnx.load_from_string(gemm_stack(seq)))
    samples = [
        {"x": rng.standard_normal((1, seq, HIDDEN)).astype("f4")} for _ in range(CALIBRATION)
    ]
    bert = ir.serde.deserialize_model(zoo.build("bert-base"))
    dims = {"batch": 1, "seq": seq}
    calibration = [synthesize(bert, dims, seed=100 + i) for i in range(CALIBRATION)]
    print("quantizing the GEMM stack and bert-base with NNCF (TRANSFORMER preset)", flush=True)
    backend = get_backend("openvino")
    options = OpenVinoOptions(release_mapped=False, release_code=False)  # as a user runs it
    gemms = backend.compile(quantize_nncf_int8(stack, samples, transformer=True), options)
    recipe = backend.compile(quantize_nncf_int8(bert, calibration, transformer=True), options)
    feeds = {"gemms": samples[0], "recipe": synthesize(bert, dims, seed=7)}
    runners = {
        "gemms": lambda: gemms.run(feeds["gemms"]),
        "recipe": lambda: recipe.run(feeds["recipe"]),
    }
    timed = interleave(runners, rounds=rounds, runs=runs)
    p50 = {name: round_p50_ms(rounds_) for name, rounds_ in timed.items()}
    share = speedup(timed["gemms"], timed["recipe"])  # P50(gemms) / P50(recipe), per round
    rate = gemm_flops(seq) / (p50["gemms"] * 1e6)
    peak = measured_peaks().int8_gops  # None: no int8 kernels measured here
    of_peak = f" = {rate / peak:.0%} of the measured int8 peak ({peak:,.0f} GOP/s)" if peak else ""
    print(
        f"bert-base int8 GEMMs only (NNCF, OpenVINO {ov.__version__}), seq {seq}: P50 "
        f"{p50['gemms']:.2f} ms, {rate:.0f} GOP/s{of_peak}"
    )
    low, high = share.spread or (share.value, share.value)
    print(
        f"bert-base, NNCF TRANSFORMER recipe by hand: P50 {p50['recipe']:.2f} ms — its GEMMs "
        f"alone are {share.value:.2f} of it (rounds {low:.2f}–{high:.2f})"
    )
    return {
        "engine": "openvino",
        "precision": "int8",
        "gemms_p50_ms": p50["gemms"],
        "recipe_p50_ms": p50["recipe"],
        "gemms_share_of_recipe": share.value,
        "gemms_share_spread": None if share.spread is None else list(share.spread),
        "gops": rate,
        "int8_peak_gops": peak,
        "fraction_of_peak": rate / peak if peak else None,
        "openvino": ov.__version__,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--engine", choices=["ort", "openvino"], default="ort")
    parser.add_argument("--precision", choices=["fp32", "int8"], default="fp32")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved blocks (int8)")
    parser.add_argument("--runs", type=int, default=40)
    parser.add_argument("--json", default=None, help="write the figures here")
    add_arguments(parser)
    args = parser.parse_args()
    recorder = Recorder("bert_gemm_floor")
    if (args.engine, args.precision) not in {("ort", "fp32"), ("openvino", "int8")}:
        parser.error("measured: --engine ort --precision fp32, --engine openvino --precision int8")
    print("command: python " + " ".join(sys.argv))
    here = machine()
    print(f"machine: {here}")
    if args.precision == "fp32":
        result = ort_fp32(args.seq, args.runs)
    else:
        result = openvino_int8(args.seq, args.rounds, args.runs)
    result |= {"command": " ".join(sys.argv), "machine": here, "seq": args.seq}
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    recorder.write(floor_rows(result), result, args.results)


def floor_rows(result: dict) -> list[dict]:
    """The GEMM stack's P50 and rate; at int8 also its share of the recipe's time."""
    engine, precision = result["engine"], result["precision"]
    found = [row(f"bert-base GEMMs, seq {result['seq']}", result["gemms_p50_ms"], "ms",
                 model="bert-base", engine=engine, precision=precision)]  # fmt: skip
    if precision == "int8":
        found += [
            row("GEMMs' share of the NNCF recipe's time", result["gemms_share_of_recipe"], "x",
                result["gemms_share_spread"], model="bert-base", engine=engine,
                precision=precision),
            row("GEMMs' rate, fraction of the measured int8 peak", result["fraction_of_peak"],
                "x", model="bert-base", engine=engine, precision=precision),
        ]  # fmt: skip
    return found


if __name__ == "__main__":
    main()
