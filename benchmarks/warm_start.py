"""Issue-11 benchmark: does the strategy library warm-start a new model's study?

    python benchmarks/warm_start.py [--models resnet50,mobilenetv2,bert-base,gpt2,vit-b16,unet3d]
        [--extra minilm=/path/minilm.onnx ...] [--trials 16] [-o warm_start.json]

Leave-one-out: every model is tuned cold (no library); then, for each model, a warm study
starts from a library holding the cold winners of all the *other* models (same hardware
class). Reported per model: the cold study's best P50, the trial at which the warm study's
best-so-far first comes within 3 % of it, and whether that is within 25 % of the trials.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from rich.console import Console

from kiln.config import CompileConfig
from kiln.tune import parse_objectives, plan_for, tune
from kiln.tune.library import Library

WITHIN = 0.03


def best_so_far(history: list[dict]) -> list[float | None]:
    best, out = None, []
    for h in sorted(history, key=lambda h: h["trial"]):
        if h["values"]:
            best = h["values"][0] if best is None else min(best, h["values"][0])
        out.append(best)
    return out


def study(source: str, url: str, name: str, trials: int, warm: bool, say) -> dict:
    plan = plan_for(
        source, objectives=parse_objectives(["latency"]), constraints=[], base=CompileConfig(),
        trials=trials, timeout_s=None, url=url, study=name, seconds_per_trial=2.0,
        confirm_runs=200,
    )  # fmt: skip
    plan.confirm_seconds = 5.0
    return tune(plan, None, say=say, warm_start=warm).to_json()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="resnet50,mobilenetv2,bert-base,gpt2,vit-b16,unet3d")
    parser.add_argument("--extra", action="append", default=[], help="NAME=path.onnx")
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("-o", "--output", default="warm_start.json")
    args = parser.parse_args()
    console = Console(stderr=True)
    say = lambda msg: console.log(msg)  # noqa: E731
    sources = {m: f"zoo:{m}" for m in args.models.split(",") if m}
    sources |= dict(e.split("=", 1) for e in args.extra)
    work = Path(tempfile.mkdtemp(prefix="warm-start-"))
    cold_url = f"sqlite:///{work / 'cold.db'}"
    results: dict = {"trials": args.trials, "models": {}}
    for name, source in sources.items():
        say(f"cold study: {name}")
        cold = study(source, cold_url, f"cold-{name}", args.trials, False, say)
        results["models"][name] = {"cold": best_so_far(cold["history"])}
        Path(args.output).write_text(json.dumps(results, indent=2))  # an interrupted run keeps it
    cold_records = Library(cold_url).records()
    for name, source in sources.items():
        url = f"sqlite:///{work / f'warm-{name}.db'}"
        library = Library(url)
        for record in cold_records:
            if record.model != name.split(":")[-1] and record.model != Path(source).stem:
                library.add(record)
        say(f"warm study: {name} (from {len(library.records())} other models)")
        warm = study(source, url, f"warm-{name}", args.trials, True, say)
        curve, cold_curve = best_so_far(warm["history"]), results["models"][name]["cold"]
        target = min(v for v in cold_curve if v is not None) * (1 + WITHIN)
        reached = next((i + 1 for i, v in enumerate(curve) if v is not None and v <= target),
                       None)  # fmt: skip
        results["models"][name] |= {
            "warm": curve, "warm_start": warm["warm_start"], "target_ms": target,
            "reached_at_trial": reached,
            "within_quarter": reached is not None and reached <= 0.25 * args.trials,
        }  # fmt: skip
        say(f"{name}: within 3 % of the cold best at trial {reached} of {args.trials}")
        Path(args.output).write_text(json.dumps(results, indent=2))
    results["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    Path(args.output).write_text(json.dumps(results, indent=2))
    for name, r in results["models"].items():
        print(f"{name:12s} reached at trial {r['reached_at_trial']} / {args.trials}: "
              f"{'yes' if r['within_quarter'] else 'no'}")  # fmt: skip


if __name__ == "__main__":
    main()
