"""One study's trials: each suggestion turned into a config, skipped when it is a duplicate or
predicted over the memory cap, else run and judged (over the cap, out of time, failed, or
training worse than the base)."""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kiln.errors import KilnError
from kiln.train.config import TrainConfig
from kiln.train.tuning.memory_model import Point, group_of, over_limit, predicted_over
from kiln.train.tuning.probe import Probe, Run, figures
from kiln.train.tuning.space import TrainSpace, describe

Say = Callable[[str], None]
LOSS_TOLERANCE = 0.02  # a trial's late loss may be this much (relative) above the base's
IDLE_ASKS = 20  # suggestions in a row that need no run (duplicates, predicted over) end it
TRIAL_FLOOR_S = 300.0  # without `seconds`: a trial may take this, or 10 × the base, at least


@dataclass
class Search:
    """One study's trials: what was measured, the loss reference, the memory model."""

    study: Any
    space: TrainSpace
    probe: Probe
    target_loss: float | None
    say: Say
    queue: list[dict[str, Any]] = field(default_factory=list)  # params to try first
    seen: dict[str, int] = field(default_factory=dict)  # config key → trial number
    points: list[Point] = field(default_factory=list)
    reference: dict[str, Any] | None = None  # {"trial", "loss"}: what trials must match
    ran: int = 0  # trials run (in this study, this call or before)
    base_wall_s: float | None = None

    def load(self) -> None:
        """A resumed study: what its trials measured counts."""
        for trial in self.study.trials:
            attrs = trial.user_attrs
            if "key" not in attrs or "duplicate_of" in attrs or trial.state.name == "FAIL":
                continue
            self.seen.setdefault(attrs["key"], trial.number)
            if attrs.get("point"):
                group, micro, peak = attrs["point"]
                self.points.append((tuple(group), micro, peak))
            if attrs.get("ran"):
                self.ran += 1
            if attrs.get("reference") and self.reference is None:
                self.reference = {"trial": trial.number, "loss": attrs["measure"]["loss"]}

    def run(self, trials: int, until: Callable[[], float | None]) -> None:
        idle = 0
        while self.ran < trials and idle < IDLE_ASKS and _left(until()) > 0:
            idle = 0 if self.step(until(), trials) else idle + 1

    def step(self, deadline: float | None, trials: int) -> bool:
        """One suggestion; whether a child ran for it."""
        if self.queue:
            self.study.enqueue_trial(self.queue.pop(0))
        with warnings.catch_warnings():  # Optuna's note that heartbeats need optimize():
            warnings.filterwarnings("ignore", "Heartbeat", UserWarning)  # one worker, no need
            trial = self.study.ask()
        params = self.space.suggest(trial)
        try:
            config = self.space.config(params)
        except KilnError as exc:
            return self._prune(trial, f"not a valid config: {exc}")
        key = self.space.key(config)
        trial.set_user_attr("key", key)
        if key in self.seen:
            return self._duplicate(trial, self.seen[key])
        skip = self._predicted_over(config)
        if skip:
            return self._prune(trial, skip)
        self.seen[key] = trial.number
        self.say(f"trial {self.ran + 1}/{trials}: {describe(config)}")
        try:
            run = self.probe.run(config, self.trial_deadline(deadline))
        except BaseException:  # stopped mid-trial (Ctrl-C): a resumed study measures it again
            self._fail(trial)
            raise
        self.ran += 1
        trial.set_user_attr("ran", True)
        if params == self.space.base_params:
            self.base_wall_s = run.wall_s
        self._judge(trial, params, config, run)
        return True

    def trial_deadline(self, deadline: float | None) -> float | None:
        """When a run must end: the user's --time, else a generous multiple of the base's."""
        if deadline is not None or self.base_wall_s is None:
            return deadline  # the base itself: as long as the user's own training takes
        return time.monotonic() + max(TRIAL_FLOOR_S, 10 * self.base_wall_s)

    def _judge(self, trial: Any, params: dict[str, Any], config: TrainConfig, run: Run) -> None:
        if run.state != "ok":
            self._stopped(trial, params, config, run)
            return
        measure = figures(run, self.target_loss)
        trial.set_user_attr("measure", measure)
        self._point(trial, config, measure["peak_mib"])
        if self.reference is None and measure["peak_mib"] <= (self.probe.cap_mib or math.inf):
            # the base; or, when it did not fit, the first run that did (its lean variant)
            self.reference = {"trial": trial.number, "loss": measure["loss"]}
            trial.set_user_attr("reference", True)
        why = self._rejected(measure)
        if why:
            self._prune(trial, why)
            return
        value = measure["samples_per_s"] if self.target_loss is None else measure["time_to_loss"]
        self.study.tell(trial, value)
        self.say(f"  {measure['samples_per_s']:.1f} samples/s, peak "
                 f"{measure['peak_mib']:.0f} MiB, loss {measure['loss']:.4f}")  # fmt: skip

    def _stopped(self, trial: Any, params: dict[str, Any], config: TrainConfig, run: Run) -> None:
        """A run that did not finish: over memory (then, for the base, its lean variant is
        tried next), out of time, or failed."""
        if run.state == "over-memory":
            self._point(trial, config, run.peak_mib)  # a lower bound: it was stopped
            if params == self.space.base_params and self.reference is None:
                self.queue.insert(0, self.space.lean_params())
        trial.set_user_attr("measure", {"peak_mib": run.peak_mib, "wall_s": run.wall_s})
        self._prune(trial, run.reason or run.state)

    def _rejected(self, measure: dict[str, Any]) -> str | None:
        """Why a measured run does not count (None: it does)."""
        cap = self.probe.cap_mib
        if cap is not None and measure["peak_mib"] > cap:
            return (f"over the memory limit: peaked at {over_limit(measure['peak_mib'], cap)} "
                    "between two polls")  # fmt: skip
        worse = self._worse(measure["loss"])
        if worse:
            return worse
        if self.target_loss is not None and measure["time_to_loss"] is None:
            return (f"the loss did not reach {self.target_loss:g} in {self.probe.steps} steps "
                    f"(last {measure['loss_curve'][-1]:.4f})")  # fmt: skip
        return None

    def _worse(self, loss: float | None) -> str | None:
        """Why a trial's late loss fails the base's (None: it trains as well)."""
        assert self.reference is not None
        ref = self.reference["loss"]
        if loss is None or ref is None:
            return "its loss is not finite" if loss is None else None
        if loss > ref * (1 + LOSS_TOLERANCE):
            return (f"trains worse: its mean loss over the last third of the steps is "
                    f"{loss:.4f}, the base's {ref:.4f} (more than {LOSS_TOLERANCE:.0%} "
                    "above)")  # fmt: skip
        return None

    def _predicted_over(self, config: TrainConfig) -> str | None:
        return predicted_over(self.points, config, self.probe.cap_mib)

    def _point(self, trial: Any, config: TrainConfig, peak: float) -> None:
        point = (group_of(config), config.micro_batch, peak)
        self.points.append(point)
        trial.set_user_attr("point", point)

    def _duplicate(self, trial: Any, number: int) -> bool:
        import optuna

        same = self.study.trials[number]
        trial.set_user_attr("duplicate_of", number)
        for key in ("measure", "reason"):
            if key in same.user_attrs:
                trial.set_user_attr(key, same.user_attrs[key])
        if same.state == optuna.trial.TrialState.COMPLETE:
            self.study.tell(trial, same.value)
        else:
            self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        return False

    def _fail(self, trial: Any) -> None:
        import optuna

        with contextlib.suppress(Exception):  # the stop that got here is what the user hears
            self.study.tell(trial, state=optuna.trial.TrialState.FAIL)

    def _prune(self, trial: Any, reason: str) -> bool:
        import optuna

        trial.set_user_attr("reason", reason)
        self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        self.say(f"  pruned: {reason}")
        return False


def _left(deadline: float | None) -> float:
    return math.inf if deadline is None else deadline - time.monotonic()
