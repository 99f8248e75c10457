"""The peak memory of compiling a large external-data model, against its weights.

    python benchmarks/compile_memory.py                       # 2.5 GiB: 40 x 4096² fp32 MatMuls
    python benchmarks/compile_memory.py --layers 4 --width 2048   # 64 MiB, a quick check

Writes an MLP (MatMul + Relu layers of random fp32 weights, external data) in a process of
its own, then runs `kiln optimize MODEL -o OUT` (the defaults: verified, timed against ONNX
Runtime as-is, its memory measured) under a small parent that reads the child's peak resident
memory from the kernel (`getrusage(RUSAGE_CHILDREN).ru_maxrss`, as GNU time's %M). Reports that
peak, Kiln's own `compile` figure from the manifest, both over the weights' bytes, and the
wall time. Prints the command, machine, versions and every figure; writes JSON and the result
file. The default 2.5 GiB model takes several minutes (the compile is verified and timed); the
quick check well under a minute.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import onnxruntime
from _results import Recorder, add_arguments, row  # benchmarks/ is the script's own directory

import kiln
from kiln.hardware import cpu_info

_WRITE = """
import sys
import numpy as np, onnx
from onnx import TensorProto, helper, numpy_helper
path, layers, width = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rng = np.random.default_rng(0)
nodes, weights, previous = [], [], "x"
for i in range(layers):
    w = rng.standard_normal((width, width), dtype=np.float32) / np.float32(width**0.5)
    weights.append(numpy_helper.from_array(w, f"w{i}"))
    nodes.append(helper.make_node("MatMul", [previous, f"w{i}"], [f"m{i}"], name=f"matmul{i}"))
    nodes.append(helper.make_node("Relu", [f"m{i}"], [f"h{i}"], name=f"relu{i}"))
    previous = f"h{i}"
graph = helper.make_graph(
    nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, width])],
    [helper.make_tensor_value_info(previous, TensorProto.FLOAT, [1, width])], weights)
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True,
                location=path.rsplit("/", 1)[-1] + ".data", size_threshold=1024)
"""
# A parent of a few MiB: ru_maxrss of its children is then the child's own peak.
_MEASURE = """
import resource, subprocess, sys
code = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, code)
"""


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--json", default="results/compile_memory.json")
    add_arguments(parser)
    args = parser.parse_args()
    recorder = Recorder("compile_memory")
    cpu = cpu_info()
    print(" ".join([Path(sys.executable).name, *sys.argv]))
    print(f"{cpu.model}, {cpu.logical_cores} cores, {platform.platform()}")
    print(f"kiln {kiln.__version__}, onnxruntime {onnxruntime.__version__}", flush=True)
    weights_mib = args.layers * args.width**2 * 4 / 2**20
    with tempfile.TemporaryDirectory(prefix="compile-memory-") as tmp:
        model, out = Path(tmp) / "mlp.onnx", Path(tmp) / "mlp.kiln"
        print(f"writing {args.layers} x {args.width}² fp32 = {weights_mib:,.0f} MiB", flush=True)
        cmd = [sys.executable, "-c", _WRITE, str(model), str(args.layers), str(args.width)]
        subprocess.run(cmd, check=True)
        optimize = [sys.executable, "-m", "kiln", "optimize", str(model), "-o", str(out)]
        print(" ".join(["kiln", *optimize[3:]]), flush=True)
        start = time.perf_counter()
        line = subprocess.run([sys.executable, "-c", _MEASURE, *optimize], check=True,
                              capture_output=True, text=True).stdout.split()  # fmt: skip
        wall = time.perf_counter() - start
        peak_mib, code = int(line[0]) / 1024, int(line[1])
        if code != 0:
            raise SystemExit(f"kiln optimize failed (exit {code})")
        manifest = json.loads((out / "manifest.json").read_text())
    kiln_mib = ((manifest.get("benchmark") or {}).get("peak_rss_mib") or {}).get("compile")
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"cpu": cpu.model, "cores": cpu.logical_cores, "features": cpu.features},
        "versions": {"kiln": kiln.__version__, "onnxruntime": onnxruntime.__version__},
        "weights_mib": weights_mib,
        "peak_rss_mib": peak_mib,
        "peak_over_weights": peak_mib / weights_mib,
        "kiln_compile_mib": kiln_mib,
        "kiln_compile_over_weights": kiln_mib / weights_mib if kiln_mib else None,
        "wall_s": wall,
    }
    print(f"peak resident {peak_mib:,.0f} MiB = {peak_mib / weights_mib:.2f}x the weights "
          f"({weights_mib:,.0f} MiB); Kiln's own compile figure "
          f"{kiln_mib if kiln_mib is None else f'{kiln_mib:,.0f} MiB'}; {wall:.0f} s")  # fmt: skip
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")
    recorder.write([
        row("peak resident memory of kiln optimize", peak_mib, "MiB"),
        row("peak ÷ the weights' bytes", peak_mib / weights_mib, "x"),
        row("Kiln's own compile figure ÷ the weights' bytes",
            kiln_mib / weights_mib if kiln_mib else None, "x"),
        row("wall time", wall, "s"),
    ], result, args.results)  # fmt: skip


if __name__ == "__main__":
    main()
