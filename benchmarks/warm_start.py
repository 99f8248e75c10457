"""Does the strategy library warm-start a new model's study?

    python benchmarks/warm_start.py [--models resnet50,mobilenetv2,bert-base,gpt2,vit-b16,unet3d]
        [--extra minilm=/path/minilm.onnx ...] [--trials 16] [--cold sqlite:///cold.db]
        [--full-warm] [-o warm_start.json]

Leave-one-out: every model is tuned cold (no library); then, for each model, a warm study
starts from a library holding the cold winners of all the *other* models (same hardware
class). Reported per model: the cold study's best P50, the trial at which the warm study's
best-so-far first comes within 3 % of it (each study's own measurements), and — the verdict —
the warm study's best configuration within its first 25 % of trials timed *interleaved*
against the cold study's best (two studies run minutes apart on a shared machine cannot be
compared by their own numbers): within 3 % when that P50 ratio is ≤ 1.03.

A warm study runs only its first 25 % of trials unless `--full-warm` (the verdict needs no
more: the trials after them cannot change what the first ones found). `--cold URL` reuses the
cold studies of an earlier run (their storage, printed at its start) instead of tuning again.
The default run tunes six full-size models cold (16 trials each) and warm: a few hours on 2
cores; `--models resnet-tiny,bert-tiny,gpt2-tiny --trials 8` takes minutes.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from _results import Recorder, add_arguments, row  # benchmarks/ is the script's own directory
from rich.console import Console

from kiln.config import CompileConfig
from kiln.ir.load import load_model
from kiln.tune import parse_objectives, plan_for, tune
from kiln.tune.bench import Workbench
from kiln.tune.library import Library
from kiln.tune.measure import duel
from kiln.tune.space import Space, choice_of

WITHIN = 0.03


def best_so_far(history: list[dict]) -> list[float | None]:
    best, out = None, []
    for h in sorted(history, key=lambda h: h["trial"]):
        if h["values"]:
            best = h["values"][0] if best is None else min(best, h["values"][0])
        out.append(best)
    return out


def plan_of(source: str, url: str, name: str, trials: int):
    plan = plan_for(
        source, objectives=parse_objectives(["latency"]), constraints=[], base=CompileConfig(),
        trials=trials, timeout_s=None, url=url, study=name, seconds_per_trial=2.0,
        confirm_runs=200,
    )  # fmt: skip
    plan.confirm_seconds = 5.0
    return plan


def study(source: str, url: str, name: str, trials: int, warm: bool, say) -> dict:
    return tune(plan_of(source, url, name, trials), None, say=say, warm_start=warm).to_json()


def earlier(url: str, name: str) -> list[dict]:
    """A finished study's history, as `tune` reports it."""
    import optuna

    trials = optuna.load_study(study_name=name, storage=url).trials
    return [{"trial": t.number, "values": t.values, "params": t.params} for t in trials]


def best_params(history: list[dict], first: int | None = None) -> dict | None:
    done = [h for h in sorted(history, key=lambda h: h["trial"])[:first] if h["values"]]
    return min(done, key=lambda h: h["values"][0])["params"] if done else None


def interleaved(source: str, warm: dict, cold: dict, seconds: float = 20.0) -> dict:
    """P50 of the warm pick over the cold pick, both built now and timed alternately."""
    plan = plan_of(source, "sqlite://", "check", 1)
    loaded = load_model(source)
    space = Space.for_model(plan.engines, plan.precisions)
    bench = Workbench(loaded, plan.base, plan.objectives, [], seconds)
    a, b = (bench.build(choice_of(p, space, loaded.model, plan.base)) for p in (warm, cold))
    fight = duel(a.runners[0], b.runners[0], seconds=seconds, min_runs=200)
    return fight.ratio.to_json()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="resnet50,mobilenetv2,bert-base,gpt2,vit-b16,unet3d")
    parser.add_argument("--extra", action="append", default=[], help="NAME=path.onnx")
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--cold", help="storage URL of an earlier run's cold studies")
    parser.add_argument("--full-warm", action="store_true", help="run every warm trial")
    parser.add_argument("-o", "--output", default="warm_start.json")
    add_arguments(parser)
    args = parser.parse_args()
    recorder = Recorder("warm_start")
    console = Console(stderr=True)
    say = lambda msg: console.log(msg)  # noqa: E731
    sources = {m: f"zoo:{m}" for m in args.models.split(",") if m}
    sources |= dict(e.split("=", 1) for e in args.extra)
    work = Path(tempfile.mkdtemp(prefix="warm-start-"))
    cold_url = args.cold or f"sqlite:///{work / 'cold.db'}"
    say(f"cold studies in {cold_url}")
    results: dict = {"trials": args.trials, "models": {}}
    colds: dict[str, dict] = {}
    for name, source in sources.items():
        say(f"cold study: {name}")
        history = (
            earlier(cold_url, f"cold-{name}") if args.cold
            else study(source, cold_url, f"cold-{name}", args.trials, False, say)["history"]
        )  # fmt: skip
        results["models"][name] = {"cold": best_so_far(history)}
        colds[name] = best_params(history) or {}
        Path(args.output).write_text(json.dumps(results, indent=2))  # an interrupted run keeps it
    cold_records = Library(cold_url).records()
    for name, source in sources.items():
        url = f"sqlite:///{work / f'warm-{name}.db'}"
        library = Library(url)
        for record in cold_records:
            if record.model != name.split(":")[-1] and record.model != Path(source).stem:
                library.add(record)
        say(f"warm study: {name} (from {len(library.records())} other models)")
        quarter = max(1, int(0.25 * args.trials))
        warm_trials = args.trials if args.full_warm else quarter
        warm = study(source, url, f"warm-{name}", warm_trials, True, say)
        curve, cold_curve = best_so_far(warm["history"]), results["models"][name]["cold"]
        target = min(v for v in cold_curve if v is not None) * (1 + WITHIN)
        reached = next((i + 1 for i, v in enumerate(curve) if v is not None and v <= target),
                       None)  # fmt: skip
        early = best_params(warm["history"], quarter)
        ratio = interleaved(source, early, colds[name]) if early else None
        results["models"][name] |= {
            "warm": curve, "warm_start": warm["warm_start"], "target_ms": target,
            "reached_at_trial": reached, "quarter": quarter,
            "warm_quarter_vs_cold_best": ratio,
            "within_quarter": ratio is not None and ratio["value"] <= 1 + WITHIN,
        }  # fmt: skip
        say(
            f"{name}: the warm study's best of its first {quarter} trials runs at "
            f"{ratio['value'] if ratio else float('nan'):.3f}× the cold best's P50 (interleaved)"
        )
        Path(args.output).write_text(json.dumps(results, indent=2))
    results["date"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    Path(args.output).write_text(json.dumps(results, indent=2))
    rows = []
    for name, r in results["models"].items():
        ratio = r["warm_quarter_vs_cold_best"]
        print(f"{name:12s} first {r['quarter']} warm trials' best / cold best: "
              f"{ratio['value'] if ratio else float('nan'):.3f} "
              f"({'yes' if r['within_quarter'] else 'no'})")  # fmt: skip
        rows.append(row(
            f"{name}: best of the first {r['quarter']} warm trials ÷ the cold best (P50)",
            ratio["value"] if ratio else None, "x",
            verdict="within 3 %" if r["within_quarter"] else "not within 3 %", model=name,
        ))  # fmt: skip
    recorder.write(rows, results, args.results)


if __name__ == "__main__":
    main()
