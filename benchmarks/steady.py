"""What each part of Kiln's steady runtime profile does to the tail.

    python benchmarks/steady.py [--models zoo:resnet50,zoo:bert-base] [--engines ort,openvino]
        [--runs 1000] [--windows 10] [--out results/steady.json]

Per model and engine, one `kiln.Session` per variant, all timed in one process in interleaved
blocks (kiln.timing.interleave: `--windows` blocks of `--runs`/`--windows` runs per variant,
rotating order), with a window of the host's jitter floor probes (kiln.hardware.jitter) after
each round, so the floor printed beside the jitters is this run's:

- as-is: the engine's own behaviour (ONNX Runtime's pool spinning, no warm-up, no freeze);
- +stop_spinning (ONNX Runtime only: session.force_spinning_stop);
- +denormals: `flush_denormals` (session.set_denormal_as_zero / CPU_DENORMALS_OPTIMIZATION);
- +threads (ONNX Runtime only): an explicit thread count, one per physical core, as the tuner
  sets one: ONNX Runtime then pins nothing (as-is, its own default count, is pinned by it);
- +pinning: `pin_threads` (ONNX Runtime: that explicit count, pinned again; OpenVINO:
  ENABLE_CPU_PINNING, which it already does by default on Linux);
- +gc.freeze: the session's warm-up at its largest shape and the GC freeze (`steady=True`);
- all: every one of them.

Both engines flush denormals on the thread that runs them too (ONNX Runtime: the thread that
opens the process's first session follows that session's option; OpenVINO: each inference
sets it): so the as-is ONNX Runtime session is opened first, and every OpenVINO variant says
its denormal choice explicitly (NO resets the thread). gc.freeze is process-wide, so each run
sets the freeze its variant wants before running (O(1) either way, in every variant's time).

Per variant: P50, P99 with a bootstrap interval (95 %), jitter (P99 − P50)/P50 with its
interval, and each ratio to as-is. Prints the command, the machine (kiln doctor's CPU line),
the versions and the table; writes JSON (`--out`). Timings on a busy machine mean nothing:
run it on a quiet one; `--runs 40 --windows 4` with tiny models checks the mechanics (under a
minute). The default run (two full-size models × two engines, 1,000 runs per variant) takes
about 15 minutes on 2 cores. Also writes the result file.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from _results import Recorder, add_arguments, row  # benchmarks/ is the script's own directory

import kiln
from kiln.backends import get_backend
from kiln.backends.cpus import allowed_cpus, physical_cores
from kiln.hardware import cpu_info
from kiln.hardware.jitter import FloorSampler
from kiln.ir.inputs import synthesize
from kiln.timing import MIN_RUNS_FOR_P99, interleave, round_stats, tail_interval

VARIANTS = ("as-is", "+stop_spinning", "+denormals", "+threads", "+pinning", "+gc.freeze", "all")
ORT_ONLY = ("+stop_spinning", "+threads")


def variant_settings(engine: str, variant: str) -> tuple[dict[str, Any], bool]:
    """The engine options and the session's `steady` for one variant."""
    if engine == "ort":
        cores = len(physical_cores(allowed_cpus()))
        parts = {
            "as-is": {"stop_spinning": False},
            "+stop_spinning": {"stop_spinning": True},
            "+denormals": {"stop_spinning": False, "flush_denormals": True},
            # An explicit count, as the tuner sets: ONNX Runtime then pins nothing itself.
            "+threads": {"stop_spinning": False, "intra_op_threads": cores},
            "+pinning": {"stop_spinning": False, "intra_op_threads": cores, "pin_threads": True},
            "+gc.freeze": {"stop_spinning": False},
        }
        every = {"stop_spinning": True, "flush_denormals": True, "intra_op_threads": cores,
                 "pin_threads": True}  # fmt: skip
    else:
        # f32 as Kiln's fp32 default; denormals said explicitly (see the module docstring).
        base = {"inference_precision": "f32", "flush_denormals": False}
        parts = {
            "as-is": base,
            "+denormals": {**base, "flush_denormals": True},
            "+pinning": {**base, "pin_threads": True},
            "+gc.freeze": base,
        }
        every = {**base, "flush_denormals": True, "pin_threads": True}
    if variant == "all":
        return every, True
    return parts[variant], variant == "+gc.freeze"


def open_variants(model: str, engine: str) -> dict[str, Callable[[], object]]:
    """One session per variant (as-is first: see the docstring), each run as a callable that
    first sets the process's GC freeze its variant wants."""
    runners: dict[str, Callable[[], object]] = {}
    feeds = None
    for variant in VARIANTS:
        if engine != "ort" and variant in ORT_ONLY:
            continue  # OpenVINO has no spinning pool to stop; its count keeps its pinning
        options, steady = variant_settings(engine, variant)
        session = kiln.Session(model, backend=engine, options=options, steady=steady)
        feeds = feeds if feeds is not None else synthesize(session.interface)
        runners[variant] = _runner(session, feeds, frozen=steady)
    return runners


def _runner(session: kiln.Session, feeds: dict[str, np.ndarray], frozen: bool) -> Callable:
    def run() -> object:
        if frozen:
            gc.freeze()
        else:
            gc.unfreeze()
        return session.run(None, feeds)

    return run


def measure(model: str, engine: str, runs: int, windows: int, seed: int) -> dict[str, Any]:
    runners = open_variants(model, engine)
    per_window = max(runs // windows, 1)
    floor = FloorSampler()
    samples = interleave(
        runners, rounds=windows, runs=per_window, warmup=20,
        on_round=lambda _i: floor.window(per_window),
    )  # fmt: skip
    gc.unfreeze()  # the steady sessions' freeze is theirs to give back; the runs' is ours
    base = round_stats(samples["as-is"])
    out: dict[str, Any] = {"floor": floor.result(seed, "interleaved with the variants").to_json()}
    for variant, rounds in samples.items():
        point, interval = round_stats(rounds), tail_interval(rounds, seed=seed)
        out[variant] = {
            "options": variant_settings(engine, variant)[0],
            "steady": variant_settings(engine, variant)[1],
            **point.to_json(),
            "p99_interval_ms": list(interval.p99_ms),
            "jitter_interval": list(interval.jitter),
            "p99_backed": point.runs >= MIN_RUNS_FOR_P99,
            "p50_vs_as_is": point.p50_ms / base.p50_ms,
            "p99_vs_as_is": point.p99_ms / base.p99_ms,
        }
    return out


def print_table(model: str, engine: str, figures: dict[str, Any]) -> None:
    floor = figures["floor"]
    low, high = floor["floor_interval"]
    print(f"\n{model} on {engine}: floor {floor['floor']:.3f} ({low:.3f}–{high:.3f}, "
          f"{floor['probe']})")  # fmt: skip
    print(f"  {'variant':<15} {'P50 ms':>9} {'P99 ms':>9} {'P99 interval':>17} "
          f"{'jitter':>7} {'interval':>13} {'×floor':>7} {'P99/as-is':>9}")  # fmt: skip
    for variant, f in figures.items():
        if variant == "floor":
            continue
        p99_low, p99_high = f["p99_interval_ms"]
        j_low, j_high = f["jitter_interval"]
        times = f["jitter"] / floor["floor"] if floor["floor"] > 0 else float("nan")
        print(
            f"  {variant:<15} {f['p50_ms']:9.3f} {f['p99_ms']:9.3f} "
            f"{p99_low:8.3f}–{p99_high:<8.3f} {f['jitter']:7.3f} {j_low:6.3f}–{j_high:<6.3f} "
            f"{times:7.2f} {f['p99_vs_as_is']:9.3f}"
        )


def machine() -> dict[str, Any]:
    cpu = cpu_info()
    line = (f"{cpu.model}, {cpu.physical_cores} physical / {cpu.logical_cores} logical cores, "
            f"{' '.join(cpu.features)}")  # fmt: skip
    return {"cpu": line, "platform": platform.platform(), "allowed_cpus": allowed_cpus()}


def versions(engines: list[str]) -> dict[str, str]:
    out = {"kiln": kiln.__version__, "python": platform.python_version(),
           "numpy": np.__version__}  # fmt: skip
    for engine in engines:
        described = get_backend(engine).describe()
        out[described["engine"]] = described["version"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="zoo:resnet50,zoo:bert-base")
    parser.add_argument("--engines", default="ort,openvino")
    parser.add_argument("--runs", type=int, default=1000, help="per variant, over all windows")
    parser.add_argument("--windows", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0, help="of the bootstrap")
    parser.add_argument("--out", default="results/steady.json")
    add_arguments(parser)
    args = parser.parse_args()
    recorder = Recorder("steady")
    engines = args.engines.split(",")
    result: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": machine(),
        "versions": versions(engines),
        "runs_per_variant": args.runs,
        "windows": args.windows,
        "models": {},
    }
    print(result["command"])
    print(result["machine"]["cpu"])
    print(", ".join(f"{k} {v}" for k, v in result["versions"].items()))
    for model in args.models.split(","):
        for engine in engines:
            figures = measure(model, engine, args.runs, args.windows, args.seed)
            result["models"].setdefault(model, {})[engine] = figures
            print_table(model, engine, figures)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nwrote {out}")
    recorder.write(steady_rows(result["models"]), result, args.results)


def steady_rows(models: dict[str, Any]) -> list[dict[str, Any]]:
    """Each variant's jitter with its bootstrap interval, and its P99 over as-is's."""
    found = []
    for model, by_engine in models.items():
        for engine, figures in by_engine.items():
            for variant, f in figures.items():
                if variant == "floor":
                    continue
                found.append(row(f"{model} on {engine}, {variant}: jitter", f["jitter"], "",
                                 f["jitter_interval"], model=model, engine=engine,
                                 variant=variant, p50_ms=f["p50_ms"], p99_ms=f["p99_ms"],
                                 p99_vs_as_is=f["p99_vs_as_is"]))  # fmt: skip
    return found


if __name__ == "__main__":
    main()
