"""`engine="auto"` / `precision="auto"`: every concrete candidate, each built and verified, timed
interleaved against the original under ONNX Runtime's defaults; the fastest verified one wins.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kiln.backends import available_backends, get_backend
from kiln.backends.ort import OrtOptions
from kiln.compiler.candidate import CompileResult
from kiln.config import AUTO, ENGINES, PRECISIONS, CompileConfig
from kiln.errors import KilnError
from kiln.ir.inputs import synthesize
from kiln.precision import ENGINES_FOR, check_precision
from kiln.timing import interleave, round_stats, speedups

Say = Callable[[str], None]


def candidates(config: CompileConfig) -> list[CompileConfig]:
    """The concrete configs `config` stands for: itself, or one per installed engine
    (engine auto) and per precision that engine runs (precision auto)."""
    if config.engine == AUTO:
        if config.engine_options:
            raise KilnError("engine options apply to one engine: give --backend ort|openvino.")
        engines = [e for e in available_backends() if e in ENGINES]
    else:
        get_backend(config.engine)  # fails now, with its reason, if the engine is missing
        engines = [config.engine]
    levels = list(PRECISIONS) if config.precision == AUTO else [config.precision]
    pairs = [(e, p) for p in levels for e in engines if e in ENGINES_FOR[p]]
    if not pairs:
        check_precision(engines[0] if engines else config.engine, config.precision)
        raise KilnError(f"no installed engine runs {config.precision}; install openvino.")
    return [config.replace(engine=e, precision=p) for e, p in pairs]


def time_candidates(results: list[CompileResult], rounds: int, runs: int, say: Say) -> dict:
    """The original under ORT_ENABLE_ALL against each candidate, interleaved in one process,
    on the first reference input set."""
    original = results[0].loaded.model
    feeds = results[0].feeds[0] if results[0].feeds else synthesize(original)
    baseline = get_backend("ort").compile(
        original,
        OrtOptions(optimization="all", stop_spinning=False),  # ORT as-is
    )
    runners = {"ort": lambda: baseline.run(feeds)}
    for result in results:
        exe = get_backend(result.backend).compile(result.model, result.options)
        runners[result.label] = (lambda e: lambda: e.run(feeds))(exe)
    say("timing the original (ORT_ENABLE_ALL) and the artifact, interleaved")
    samples = interleave(
        runners, rounds=rounds, runs=runs, on_round=lambda r: say(f"timing round {r}/{rounds}")
    )
    compared = speedups(samples, "ort")
    return {
        "rounds": rounds,
        "runs_per_round": runs,
        "original_ort": round_stats(samples["ort"]).to_json(),
        "candidates": {
            r.label: {**round_stats(samples[r.label]).to_json(), **compared[r.label].to_json()}
            for r in results
        },
    }


def fastest(results: list[CompileResult], timing: dict[str, Any]) -> tuple[CompileResult, dict]:
    """The verified candidate with the best speedup, and the manifest's benchmark: its speedup,
    spread and verdict against the original, and every candidate's."""
    timed = timing["candidates"]
    best = max(results, key=lambda r: timed[r.label]["speedup"])
    chosen = timed[best.label]
    bench = {
        "rounds": timing["rounds"],
        "runs_per_round": timing["runs_per_round"],
        "original_ort": timing["original_ort"],
        "artifact": chosen,
        "speedup": chosen["speedup"],
        "speedup_spread": chosen["speedup_spread"],
        "verdict": chosen["verdict"],
        "choice": best.label,
        "candidates": {name: c["speedup"] for name, c in timed.items()},
        "candidate_verdicts": {
            name: {k: c[k] for k in ("speedup", "speedup_spread", "verdict")}
            for name, c in timed.items()
        },
    }
    return best, bench
