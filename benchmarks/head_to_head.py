"""Kiln's artifact against one hand-run peer, in several fresh processes, creation order alternated.

    python benchmarks/head_to_head.py ARTIFACT --peer openvino-int8 [--processes 4] \
        [--rounds 16] [--runs 20] [--inputs x.npz] [--calib DIR|c.npz] [-o head_to_head.json]

Why processes: within one process the OpenVINO model compiled first tends to run slower than
the same model compiled after it (bert-base int8 on a 2-core AVX-512 EPYC, four instances of
one file: the first slower than the round's median in 14 of 16 rounds by 0.6–0.9 %, once 5 %),
and `kiln bench` always builds Kiln's engine first. A ratio of 1.00 ± 0.02 between two such
engines says more about which was compiled first than about either. Here each process
compiles both — Kiln first in half of them, the peer first in the other half — and times them
interleaved in blocks (`rounds` × `runs`, the order alternating every round). The ratio is
the peer's P50 ÷ Kiln's per round, pooled over every process's rounds; each process's own
median says how far the processes disagree, and the verdict is `faster` only if Kiln wins in
every one.

The peer is built once here, as `kiln bench` builds it (its engine's own tool on the
artifact's original model, calibrated on the same synthetic samples), and saved for the
children to compile. Writes `-o` and the result file. The default run (4 processes × 16 rounds
× 20 runs of each engine) takes a few minutes for bert-base int8 on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx_ir as ir
from _results import Recorder, add_arguments, row  # benchmarks/ is the script's own directory

from kiln.errors import KilnError
from kiln.timing import verdict_of


def build_peer(artifact: str, peer: str, work: Path, inputs: str | None = None,
               calib: str | None = None) -> tuple[Path, Path]:  # fmt: skip
    """The peer's model (its file) and the feeds both engines run (an .npz), in `work`: the
    given inputs and calibration samples, or synthesized ones as `kiln bench` makes them."""
    from kiln.artifact.store import read_artifact
    from kiln.bench.engines import CALIBRATION_SAMPLES, engine_model
    from kiln.compiler.api import load_source
    from kiln.ir.inputs import default_dims, read_calibration, read_inputs, synthesize

    manifest = read_artifact(artifact).manifest  # read, not compiled: the children compile it
    original = load_source(manifest.source.path).model
    dims = {**default_dims(original), **manifest.dims}
    feeds = read_inputs(inputs, original) if inputs else synthesize(original, dims)
    calibration = read_calibration(calib, original) if calib else None
    if calibration is None:
        calibration = [synthesize(original, dims, seed=100 + i) for i in range(CALIBRATION_SAMPLES)]
    model_path, feeds_path = work / "peer.onnx", work / "feeds.npz"
    ir.save(engine_model(peer, original, calibration), model_path, external_data="peer.data")
    np.savez(feeds_path, **feeds)
    return model_path, feeds_path


def child(artifact: str, peer: str, model: str, feeds: str, kiln_first: bool, rounds: int,
          runs: int) -> dict:  # fmt: skip
    """Both engines compiled in the order given, timed interleaved: per-round P50s (ms)."""
    from kiln.bench.engines import engine_compile
    from kiln.runtime import Session
    from kiln.timing import interleave, round_p50_ms

    inputs = dict(np.load(feeds))

    def kiln_engine():
        session = Session(artifact)
        return lambda: session.run(None, inputs)

    def peer_engine():
        exe = engine_compile(peer, ir.load(model))
        return lambda: exe.run(inputs)

    makers = [("kiln", kiln_engine), ("peer", peer_engine)]
    runners = {name: make() for name, make in (makers if kiln_first else makers[::-1])}
    samples = interleave(runners, rounds=rounds, runs=runs)
    return {name: [round_p50_ms([block]) for block in blocks] for name, blocks in samples.items()}


def head_to_head(artifact: str, peer: str, processes: int = 4, rounds: int = 16,
                 runs: int = 20, say=print, inputs: str | None = None,
                 calib: str | None = None) -> dict:  # fmt: skip
    """Kiln ÷ `peer` over `processes` fresh processes, creation order alternated."""
    with tempfile.TemporaryDirectory(prefix="head-to-head-") as tmp:
        say(f"head-to-head: building {peer} as kiln bench does")
        model, feeds = build_peer(artifact, peer, Path(tmp), inputs, calib)
        per_process = []
        for index in range(processes):
            kiln_first = index % 2 == 0
            say(f"head-to-head: process {index + 1}/{processes} "
                f"({'Kiln' if kiln_first else peer} compiled first)")  # fmt: skip
            command = [sys.executable, __file__, artifact, "--peer", peer, "--child", str(model),
                       str(feeds), "kiln" if kiln_first else "peer", "--rounds", str(rounds),
                       "--runs", str(runs)]  # fmt: skip
            done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
            if done.returncode != 0:
                raise RuntimeError(f"head-to-head child failed: {done.stderr.strip()[-500:]}")
            blocks = json.loads(done.stdout.strip().splitlines()[-1])
            ratios = [p / k for p, k in zip(blocks["peer"], blocks["kiln"], strict=True)]
            per_process.append({"kiln_first": kiln_first, "round_ratios": ratios,
                                "ratio": statistics.median(ratios),
                                "kiln_p50_ms": statistics.median(blocks["kiln"]),
                                "peer_p50_ms": statistics.median(blocks["peer"])})  # fmt: skip
    pooled = [r for p in per_process for r in p["round_ratios"]]
    medians = [p["ratio"] for p in per_process]
    low, high = min(medians), max(medians)
    return {
        "peer": peer,
        "processes": processes,
        "rounds": rounds,
        "runs": runs,
        "why": "creation order alternated across fresh processes: within one, the model "
        "compiled first tends to run slower (0.6-5 %)",
        "kiln_vs_peer": statistics.median(pooled),  # the peer's P50 ÷ Kiln's, pooled rounds
        "process_range": [low, high],
        "verdict": verdict_of(low, high),
        "kiln_first": statistics.median([p["ratio"] for p in per_process if p["kiln_first"]]),
        "peer_first": statistics.median(
            [p["ratio"] for p in per_process if not p["kiln_first"]] or [float("nan")]
        ),
        "per_process": per_process,
    }


def describe(result: dict) -> str:
    return (
        f"head-to-head vs {result['peer']} over {result['processes']} processes "
        f"({result['rounds']} × {result['runs']} each, creation order alternated): Kiln "
        f"{result['kiln_vs_peer']:.3f}× (processes {result['process_range'][0]:.3f}–"
        f"{result['process_range'][1]:.3f}: {result['verdict']}; Kiln compiled first "
        f"{result['kiln_first']:.3f}×, the peer first {result['peer_first']:.3f}×)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("artifact")
    parser.add_argument("--peer", default="openvino-int8")
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--inputs", help="the inputs both engines run (.npz; default synthesized)")
    parser.add_argument("--calib", help="the peer's calibration samples (as kiln bench --calib)")
    parser.add_argument("--child", nargs=3, metavar=("MODEL", "FEEDS", "FIRST"),
                        help=argparse.SUPPRESS)  # fmt: skip
    parser.add_argument("-o", "--output", default="head_to_head.json")
    add_arguments(parser)
    args = parser.parse_args()
    if args.processes < 1:
        parser.error("--processes: at least 1 (each compiles and times both engines)")
    if args.child:
        model, feeds, first = args.child
        print(json.dumps(child(args.artifact, args.peer, model, feeds, first == "kiln",
                               args.rounds, args.runs)))  # fmt: skip
        return
    from kiln.hardware import cpu_info

    recorder = Recorder("head_to_head")  # after the children's branch: they record nothing
    started = time.time()
    try:
        result = _measured(args)
    except (KilnError, RuntimeError) as exc:  # bad input, a child that failed: one line
        sys.exit(f"error: {exc}")
    cpu = cpu_info()
    result |= {"command": " ".join(["python", *sys.argv]), "seconds": time.time() - started,
               "machine": {"cpu": cpu.model, "cores": cpu.logical_cores,
                           "features": cpu.features}}  # fmt: skip
    Path(args.output).write_text(json.dumps(result, indent=2))
    print(f"{cpu.model}, {cpu.logical_cores} cores, {' '.join(cpu.features)}")
    print(describe(result))
    low, high = result["process_range"]
    recorder.write([row(
        f"{Path(args.artifact).stem}: Kiln vs {args.peer}", result["kiln_vs_peer"], "x",
        [low, high], result["verdict"], model=Path(args.artifact).stem, engine="kiln",
        baseline=args.peer, processes=args.processes,
    )], result, args.results)  # fmt: skip


def _measured(args: argparse.Namespace) -> dict:
    say = lambda message: print(message, file=sys.stderr)  # noqa: E731
    return head_to_head(args.artifact, args.peer, args.processes, args.rounds, args.runs,
                        say=say, inputs=args.inputs, calib=args.calib)  # fmt: skip


if __name__ == "__main__":
    main()
