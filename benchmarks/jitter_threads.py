"""Jitter: how much of an engine's tail is the host's, at each thread count?

    python benchmarks/jitter_threads.py [--model zoo:resnet50] [--rounds 10] [--runs 100] \
        [--no-openvino] [--json results/jitter_threads.json]

The same fixed work timed at 1 thread and at every core, all interleaved (round by round, so
every row sees the same moments of the machine): the model under ONNX Runtime as-is
(ORT_ENABLE_ALL, `intra_op_num_threads` = N) and under OpenVINO fp32 (LATENCY,
`INFERENCE_NUM_THREADS` = N), and the probes `kiln doctor` takes its floor from, sized to the
fastest engine's run: a pure-Python loop (one thread, always) and numpy's fp32 matmul with its
BLAS held to N threads (threadpoolctl). Each row: P50, P99, jitter (P99 − P50)/P50 with its
bootstrap interval over rounds × runs. The question it answers: when Kiln's fastest pick uses
every core and its jitter stays several times the floor, is that the engine or the machine —
does fixed work that needs every core (the matmul probe) show the same tail here?

The default run (resnet50, 10 rounds × 100 runs of each row) takes about 5 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
from _machine import machine  # benchmarks/ is the script's own directory
from _results import Recorder, add_arguments, row  # benchmarks/ is the script's own directory
from threadpoolctl import threadpool_limits

from kiln.hardware import cpu_info
from kiln.hardware.jitter import numpy_matmul_probe, python_loop_probe
from kiln.ir.inputs import synthesize
from kiln.ir.load import load_model
from kiln.timing import interleave, round_stats, tail_interval, time_runs


def _ort(path: Path, threads: int) -> Callable[[], object]:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    feeds = synthesize(ir.load(str(path)))
    return lambda: session.run(None, feeds)


def _openvino(path: Path, threads: int) -> Callable[[], object]:
    import openvino as ov

    props = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_PRECISION_HINT": "f32",
             "INFERENCE_NUM_THREADS": str(threads)}  # fmt: skip
    request = ov.Core().compile_model(str(path), "CPU", props).create_infer_request()
    feeds = synthesize(ir.load(str(path)))
    return lambda: request.infer(feeds)


def _matmul_at(threads: int, target_s: float) -> tuple[Callable[[], object], str]:
    """numpy's matmul with its BLAS held to `threads`, sized to `target_s` at that count."""
    with threadpool_limits(limits=threads):
        probe = numpy_matmul_probe(target_s)

    def limited() -> object:
        with threadpool_limits(limits=threads):
            return probe.run()

    return limited, f"{probe.work}, {threads} BLAS thread{'s' if threads > 1 else ''}"


def runners(model: str, openvino: bool, work: Path) -> tuple[dict[str, Callable], dict[str, str]]:
    path = work / "model.onnx"
    ir.save(load_model(model).model, path)
    cores = max(cpu_info().physical_cores, 1)
    counts = sorted({1, cores})
    engines: dict[str, Callable[[], object]] = {}
    for n in counts:
        engines[f"ort {n}t"] = _ort(path, n)
        if openvino:
            engines[f"openvino {n}t"] = _openvino(path, n)
    fastest = min(min(time_runs(run, 3)) for run in engines.values())
    loop = python_loop_probe(fastest)
    probes: dict[str, Callable[[], object]] = {"python-loop 1t": loop.run}
    work_of = {"python-loop 1t": loop.work}
    for n in counts:
        probes[f"numpy-matmul {n}t"], work_of[f"numpy-matmul {n}t"] = _matmul_at(n, fastest)
    return {**engines, **probes}, work_of


def rows(samples: dict[str, list[list[float]]]) -> dict[str, dict[str, Any]]:
    out = {}
    for name, rounds in samples.items():
        stats, tails = round_stats(rounds), tail_interval(rounds)
        out[name] = {
            "p50_ms": stats.p50_ms,
            "p99_ms": stats.p99_ms,
            "jitter": stats.jitter,
            "jitter_interval": list(tails.jitter),
            "runs": sum(len(r) for r in rounds),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="zoo:resnet50")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--no-openvino", action="store_true")
    parser.add_argument("--json", type=Path, default=Path("results/jitter_threads.json"))
    add_arguments(parser)
    args = parser.parse_args()
    recorder = Recorder("jitter_threads")
    info = machine()
    command = "python benchmarks/jitter_threads.py " + " ".join(
        f"--model {args.model} --rounds {args.rounds} --runs {args.runs}".split()
        + (["--no-openvino"] if args.no_openvino else [])
    )
    print(command)
    print(f"{info['cpu']}, {info['cores']} cores, {' '.join(info['features'])}")
    print(f"onnxruntime {ort.__version__}, numpy {np.__version__}")
    with tempfile.TemporaryDirectory(prefix="kiln-jitter-") as tmp:
        timed, work_of = runners(args.model, not args.no_openvino, Path(tmp))
        samples = interleave(timed, rounds=args.rounds, runs=args.runs, warmup=3)
    table = rows(samples)
    print(f"\n{'row':20} {'P50 ms':>8} {'P99 ms':>8} {'jitter':>7}  interval")
    for name, figures in table.items():
        low, high = figures["jitter_interval"]
        print(f"{name:20} {figures['p50_ms']:8.2f} {figures['p99_ms']:8.2f} "
              f"{figures['jitter']:7.3f}  "
              f"{low:.3f}–{high:.3f}")  # fmt: skip
    floor = table["python-loop 1t"]["jitter"]
    print(f"\njitter over the one-thread Python loop's ({floor:.3f}):")
    for name, figures in table.items():
        print(f"  {name:20} {figures['jitter'] / floor:6.2f}×" if floor > 0 else "")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    result = {"command": command, "machine": info, "model": args.model, "work": work_of,
              "rows": table}  # fmt: skip
    args.json.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    recorder.write([
        row(f"{name}: jitter (P99 − P50)/P50", figures["jitter"], "", figures["jitter_interval"],
            model=args.model, p50_ms=figures["p50_ms"], p99_ms=figures["p99_ms"])
        for name, figures in table.items()
    ], result, args.results)  # fmt: skip


if __name__ == "__main__":
    main()
