"""The last word on a study's pick: measured against the defaults, interleaved, over at least
1,000 runs each, and a verdict that says "better" only beyond the interval — a pick that is
not better is not written."""

from __future__ import annotations

from typing import Any

from kiln.timing import GAIN, verdict_of
from kiln.tune.bench import Built, footprint, rate_duel
from kiln.tune.measure import duel, round_p50s, speedup_interval, tails
from kiln.tune.objectives import Objective

CONFIRM_RUNS = 1000


def confirm(
    tuned: Built, base: Built, *, runs: int, seconds: float, throughput_s: float | None = None,
    limit_s: float | None = None, memory: bool = True,
) -> dict[str, Any]:  # fmt: skip
    """Tuned against the defaults, interleaved, ≥ `runs` runs each (then up to `seconds` to
    tighten the interval; never past `limit_s`, what is left of the user's --time): the
    speedup as `kiln.timing.speedup` takes it — the ratio of the two P50s reported beside it
    — with its interval, each side's tails, with `memory` each side's memory (its session's
    peak in a process of its own; None when not measured), and with `throughput_s` the
    throughput ratio over windows of that many seconds.

    For throughput a run is one batch: ≥ `runs` inferences, not runs, are what is counted
    (1,000 runs of batch 32 would take an hour where each takes a second)."""
    gains: dict[str, Any] = {}
    if throughput_s is not None:
        runs = -(-runs // max(tuned.choice.batch, base.choice.batch))
    fight = duel(tuned.runners[0], base.runners[0], seconds=seconds, runs=20, min_runs=runs,
                 tight=0.01, limit_s=limit_s)  # fmt: skip
    speed = speedup_interval(fight.incumbent_rounds, fight.trial_rounds)
    gains["speedup"] = speed.to_json() | {"runs": len(fight.trial_s), "rounds": fight.rounds}
    gains["tuned"] = tails(fight.trial_s).to_json()
    gains["defaults"] = tails(fight.incumbent_s).to_json()
    # P50 as the speedup takes it: the median of per-round medians, not of windows.
    gains["tuned"]["p50_ms"] = round_p50s(fight.trial_rounds).to_json()
    gains["defaults"]["p50_ms"] = round_p50s(fight.incumbent_rounds).to_json()
    gains["tuned"]["memory_mib"] = footprint(tuned) if memory else None
    gains["defaults"]["memory_mib"] = footprint(base) if memory else None
    if throughput_s is not None:
        gains["throughput_ratio"] = rate_duel(tuned, base, throughput_s).to_json()
    return gains


def verdict(objective: Objective, gains: dict[str, Any]) -> str:
    """ "better" only where the confirmation says so beyond its interval; else "no better"
    (within noise) or "worse"."""
    if objective.measure == "throughput" and "throughput_ratio" in gains:
        ratio = gains["throughput_ratio"]
        return verdict_of(ratio["low"], ratio["high"], GAIN)
    if objective.measure == "p50_ms":
        return verdict_of(gains["speedup"]["low"], gains["speedup"]["high"], GAIN)
    if objective.measure in ("p99_ms", "jitter"):  # lower is better: theirs − mine above 0
        mine, theirs = gains["tuned"][objective.measure], gains["defaults"][objective.measure]
        return verdict_of(theirs["low"] - mine["high"], theirs["high"] - mine["low"], GAIN,
                          mark=0.0)  # fmt: skip
    # memory: one measurement each; 5 % either way is noise
    ratio = gains["defaults"]["memory_mib"] / max(gains["tuned"]["memory_mib"], 1.0)
    return verdict_of(ratio, ratio, GAIN, margin=0.05)
