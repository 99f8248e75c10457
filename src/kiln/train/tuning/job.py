"""One call of the training tuner, settled: what it searches, where it keeps it, how long it
has."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.train.tuning.probe import Probe
from kiln.train.tuning.space import TrainSpace

CONFIRM_SHARE = 0.25  # of `seconds` kept for the confirmation, as kiln tune keeps


@dataclass
class Job:
    """One call of `tune`, settled: what it searches, where it keeps it, how long it has."""

    specs: dict[str, str | None]  # model, data, loss, optimizer as names (for the record)
    space: TrainSpace
    probe: Probe
    study: str
    url: str
    target_loss: float | None
    trials: int
    seconds: float | None
    deadline: float | None  # time.monotonic() by which the whole call ends
    signature: dict[str, Any]
    confirm_rounds: int
    seed: int | None
    warm_start: bool

    @property
    def objective(self) -> str:
        return "samples_per_s" if self.target_loss is None else f"time_to_loss{self.target_loss:g}"

    def keep_s(self, base_wall_s: float | None) -> float:
        """The confirmation's share of `seconds`: ≥ 2 runs a side at the base's pace."""
        if not self.seconds:
            return 0.0
        need = 2 * self.confirm_rounds * (base_wall_s or 0.0)
        return min(0.5 * self.seconds, max(CONFIRM_SHARE * self.seconds, need))
