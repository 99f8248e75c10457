"""Two artifacts in one process — does one session slow the other?

    python benchmarks/two_sessions.py A.kiln B.kiln [--rounds 5 --runs 20]

Each artifact opens as a `kiln.Session` (its recorded engine settings, or for an ONNX Runtime
artifact a variant of them:
`--variants spin,recorded,stop,nospin` — `spin` is ONNX Runtime's own behaviour, `stop` sets
its `session.force_spinning_stop`, the pool spinning during a run and stopping when the run
ends; `recorded` leaves the choice to Kiln; `nospin` turns spinning off).
Per variant and round, interleaved: A alone (a block of `--runs` runs), B alone, then A and B
alternating run by run (`--runs` pairs, each run timed on its own). The figure is each
session's speed alternating over its speed alone: P50 alone / P50 alternating, the median of
per-round ratios with their range (the bar: ≥ 0.9). Also each variant's speed alone
against the recorded settings alone, what the variant costs a session with the cores to
itself. Prints the command, CPU, versions and every figure; writes JSON (`--json`) and the
result file. With tiny artifacts the default run takes seconds; with full-size ones it is
4 variants × 5 rounds × 4 × 20 runs of each artifact.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import onnxruntime
from _results import Recorder, add_arguments, row  # benchmarks/ is the script's own directory

import kiln
from kiln.artifact.store import read_artifact
from kiln.hardware import cpu_info
from kiln.ir.inputs import synthesize

VARIANTS: dict[str, dict] = {
    "spin": {"stop_spinning": False},  # ONNX Runtime's own: the pool spins after each run
    "recorded": {},  # what the artifact records; unset, Kiln decides (kiln.backends.ort)
    "stop": {"stop_spinning": True},
    "nospin": {"spinning": False},
}


def opened(path: Path, variant: str) -> Callable[[], object]:
    # The variants are ONNX Runtime's pool settings: an artifact on another engine runs as
    # recorded in every variant (it is the company an ORT pool keeps).
    ort = read_artifact(path).manifest.backend.name == "ort"
    options = VARIANTS[variant] if ort else {}
    session = kiln.Session(str(path), options=options or None)
    feeds = synthesize(session.interface)
    session.run(None, feeds)
    return lambda: session.run(None, feeds)


def timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


def one_round(a: Callable, b: Callable, runs: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"a_alone": [], "b_alone": [], "a_alt": [], "b_alt": []}
    for _ in range(2):  # warm-up of each pattern, not counted
        a(), b()
    out["a_alone"] = [timed(a) for _ in range(runs)]
    out["b_alone"] = [timed(b) for _ in range(runs)]
    for _ in range(runs):
        out["a_alt"].append(timed(a))
        out["b_alt"].append(timed(b))
    return out


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--variants", default="spin,recorded,stop,nospin")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--json", default="results/two_sessions.json")
    add_arguments(parser)
    args = parser.parse_args()
    recorder = Recorder("two_sessions")
    cpu = cpu_info()
    command = " ".join([Path(sys.executable).name, *sys.argv])
    print(command)
    print(f"{cpu.model}, {cpu.logical_cores} cores, {' '.join(cpu.features)}, "
          f"{platform.platform()}; kiln {kiln.__version__}, onnxruntime "
          f"{onnxruntime.__version__}", flush=True)  # fmt: skip
    variants = args.variants.split(",")
    sessions = {v: (opened(args.a, v), opened(args.b, v)) for v in variants}
    rounds: dict[str, list[dict]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for v in variants[r % len(variants) :] + variants[: r % len(variants)]:
            rounds[v].append(one_round(*sessions[v], args.runs))
        print(f"round {r + 1}/{args.rounds}", flush=True)
    result: dict = {"command": command, "cpu": cpu.model, "features": cpu.features,
                    "a": str(args.a), "b": str(args.b), "variants": {}}  # fmt: skip
    base = {k: [statistics.median(x[f"{k}_alone"]) for x in rounds[variants[0]]] for k in "ab"}
    for v in variants:
        figures: dict = {}
        for k, name in (("a", args.a.stem), ("b", args.b.stem)):
            alone = [statistics.median(x[f"{k}_alone"]) for x in rounds[v]]
            alt = [statistics.median(x[f"{k}_alt"]) for x in rounds[v]]
            figures[name] = {
                "p50_alone_ms": statistics.median(alone) * 1e3,
                "p50_alternating_ms": statistics.median(alt) * 1e3,
                "alternating_speed": spread([s / t for s, t in zip(alone, alt, strict=True)]),
                "alone_vs_first_variant": spread(
                    [b_ / s for b_, s in zip(base[k], alone, strict=True)]
                ),
            }
            f = figures[name]
            s = f["alternating_speed"]
            print(f"{v:9} {name:12} alone {f['p50_alone_ms']:8.2f} ms  alternating "
                  f"{f['p50_alternating_ms']:8.2f} ms  speed kept {s['median']:.3f} "
                  f"({s['min']:.3f}–{s['max']:.3f})  alone vs {variants[0]} "
                  f"{f['alone_vs_first_variant']['median']:.3f}×", flush=True)  # fmt: skip
        result["variants"][v] = figures
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    rows = []
    for variant, figures in result["variants"].items():
        for name, f in figures.items():
            s = f["alternating_speed"]
            rows.append(row(
                f"{variant}, {name}: speed kept alternating", s["median"], "x",
                [s["min"], s["max"]], "pass" if s["min"] >= 0.9 else "below 0.9",
                model=name, variant=variant,
            ))  # fmt: skip
    recorder.write(rows, result, args.results)


if __name__ == "__main__":
    main()
