"""The last word on the study's pick: raced against the base in alternating child runs and
adopted only when faster beyond their spread (kiln.timing's verdict, kiln tune's interval)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kiln.timing import GAIN, verdict_of
from kiln.train.config import TrainConfig
from kiln.train.tuning.probe import Probe, figures
from kiln.train.tuning.search import Search
from kiln.tune.measure import speedup_interval

CONFIRM_ROUNDS = 2  # child runs of each side in the confirmation, alternating who goes first
BASE_BEST = "the base measured best"


def confirm(probe: Probe, pick: TrainConfig, base: TrainConfig, rounds: int,
            deadline: Callable[[], float | None],
            target_loss: float | None) -> dict[str, Any]:  # fmt: skip
    """The pick against the base in alternating child runs, `rounds` each: the speedup
    (base / pick of the median steady step, or of the time to the target loss) with the
    interval kiln tune confirms with; "better" only when its low end is above 1. "runs":
    each side's per-round figures and the order the runs went in."""
    sides: dict[str, Any] = {"base": [], "pick": [], "order": []}
    for i in range(rounds):
        order = ("base", "pick") if i % 2 == 0 else ("pick", "base")
        for name in order:
            sides["order"].append(name)
            run = probe.run(pick if name == "pick" else base, deadline())
            if run.state != "ok":
                return _stopped(f"the {name} run ended {run.reason}", sides)
            measure = figures(run, target_loss)
            if target_loss is None:
                sides[name].append(measure["step_s"])
            elif measure["time_to_loss"] is not None:
                sides[name].append([measure["time_to_loss"]])
            else:
                return _stopped(f"the {name} run did not reach {target_loss:g}", sides)
    speed = speedup_interval(sides["base"], sides["pick"])
    verdict = verdict_of(speed.low, speed.high, GAIN)  # "better" only beyond the interval
    return {"verdict": verdict, "speedup": speed.to_json(), "adopt": verdict == "better",
            "runs": sides}  # fmt: skip


def _stopped(why: str, sides: dict[str, Any]) -> dict[str, Any]:
    """A confirmation that could not finish: the base is kept."""
    return {"verdict": f"the confirmation stopped: {why}", "speedup": None, "adopt": False,
            "runs": sides}  # fmt: skip


def confirmation(search: Search, chosen: TrainConfig, deadline: float | None,
                 rounds: int) -> dict[str, Any]:  # fmt: skip
    space = search.space
    if space.key(chosen) == space.key(space.base):
        return {"verdict": BASE_BEST, "speedup": {"value": 1.0, "low": 1.0, "high": 1.0},
                "adopt": False}  # fmt: skip
    base_trial = _base_trial(search)
    if base_trial is None or base_trial.state.name != "COMPLETE":
        # Nothing to race: the base did not qualify (over the limit, failing, short of the
        # target loss); the pick did.
        why = base_trial.user_attrs.get("reason") if base_trial is not None else "not run"
        return {"verdict": f"the base did not qualify: {why}", "speedup": None, "adopt": True}
    search.say(f"confirming against the base: {rounds} runs each, alternating")
    return confirm(search.probe, chosen, space.base, rounds,
                   lambda: search.trial_deadline(deadline), search.target_loss)  # fmt: skip


def _base_trial(search: Search) -> Any | None:
    key = search.space.key(search.space.base)
    for trial in search.study.trials:
        attrs = trial.user_attrs
        if attrs.get("key") == key and attrs.get("ran") and "duplicate_of" not in attrs:
            return trial
    return None
