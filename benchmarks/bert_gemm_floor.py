"""The floor for bert-base at fp32 in ONNX Runtime: its twelve layers' GEMMs and nothing else.

    python benchmarks/bert_gemm_floor.py [--seq 128] [--runs 40]

If the whole model already runs in about this time, no fp32 graph rewrite that keeps the FLOPs
can make it much faster: only fewer FLOPs or lower precision can.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto
from onnx import helper as h
from onnx import numpy_helper as nh

HIDDEN, FFN, LAYERS = 768, 3072, 12


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
        nodes.append(h.make_node("Add", [f"y{layer}_5", f"y{layer}_3"], [f"x{layer}"]))
        x = f"x{layer}"
    graph = h.make_graph(
        nodes,
        "gemms",
        [h.make_tensor_value_info("x", TensorProto.FLOAT, [1, seq, HIDDEN])],
        [h.make_tensor_value_info(x, TensorProto.FLOAT, [1, seq, HIDDEN])],
        inits,
    )
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]).SerializeToString()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--runs", type=int, default=40)
    args = parser.parse_args()
    session = ort.InferenceSession(gemm_stack(args.seq), providers=["CPUExecutionProvider"])
    feed = {"x": np.random.default_rng(1).standard_normal((1, args.seq, HIDDEN)).astype("f4")}
    for _ in range(5):
        session.run(None, feed)
    times = []
    for _ in range(args.runs):
        start = time.perf_counter()
        session.run(None, feed)
        times.append(time.perf_counter() - start)
    p50 = statistics.median(times)
    flops = LAYERS * 2 * args.seq * (4 * HIDDEN * HIDDEN + 2 * HIDDEN * FFN)
    rate = flops / p50 / 1e9
    print(
        f"bert-base GEMMs only, seq {args.seq}: P50 {p50 * 1e3:.1f} ms, {flops / 1e9:.1f} GFLOP, "
        f"{rate:.0f} GFLOP/s (onnxruntime {ort.__version__})"
    )


if __name__ == "__main__":
    main()
