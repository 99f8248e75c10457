"""Learning-rate schedules: the rate of each optimizer step as a fraction of the optimizer's
own, as `TrainConfig.lr_schedule` and `.warmup` say — a linear warm-up, then constant, linear
or cosine decay to 0 over the run's steps — or the user's own scheduler (`module:fn`, called
with the optimizer). `Prepared.step()` steps the scheduler after each optimizer step, and a
checkpoint keeps its state (`Prepared.state()`), so a resumed run goes on at the same rate.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.optim.lr_scheduler import LambdaLR, LRScheduler, ReduceLROnPlateau

from kiln.errors import KilnError, a_type
from kiln.train.config import TrainConfig


def needs_length(config: TrainConfig) -> bool:
    """Whether the schedule decays over the run, and so needs the run's steps."""
    return config.lr_schedule in ("linear", "cosine")


def check_length(config: TrainConfig, steps: float | None) -> None:
    """Refuse a decaying schedule for a run of no known length."""
    if needs_length(config) and not steps:
        raise KilnError(f"lr_schedule {config.lr_schedule} decays over the run's steps: give "
                        "--steps or --epochs (a --time run has no known length; "
                        "prepare(..., steps=N) in a loop of your own), or use lr_schedule "
                        "constant.")  # fmt: skip


def scheduler(optimizer: torch.optim.Optimizer, config: TrainConfig,
              steps: int | None) -> LRScheduler | None:  # fmt: skip
    """The config's scheduler over `optimizer` for a run of `steps` optimizer steps; None for
    a constant rate without warm-up (the optimizer's own rate: nothing to step)."""
    name, warmup = config.lr_schedule, config.warmup
    if ":" in name:
        return _theirs(optimizer, name)
    if name == "constant" and not warmup:
        return None
    check_length(config, steps)
    total = steps or 0

    def rate(done: int) -> float:  # `done` optimizer steps taken: the next one's fraction
        return fraction(name, warmup, total, done)

    return LambdaLR(optimizer, rate)


def fraction(name: str, warmup: int, total: int, done: int) -> float:
    """The rate of the optimizer step after `done` steps, as a fraction of the full rate:
    the warm-up reaches it on its last step; the decay starts from it and would reach 0 at
    step `total` + 1, so no step of the run is taken at rate 0."""
    if done < warmup:
        return (done + 1) / warmup
    if name == "constant":
        return 1.0
    progress = min(1.0, (done - warmup) / max(1, total - warmup))
    if name == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    return 1.0 - progress


def restore(sched: LRScheduler, state: dict[str, Any], optimizer: torch.optim.Optimizer) -> None:
    """A checkpoint's scheduler state put back, and the optimizer's rate set to the one the
    next step takes (building the scheduler reset it to the first step's)."""
    sched.load_state_dict(state)
    for group, rate in zip(optimizer.param_groups, sched.get_last_lr(), strict=True):
        group["lr"] = rate


def _theirs(optimizer: torch.optim.Optimizer, spec: str) -> LRScheduler:
    from kiln.compress.loading import load_callable
    from kiln.train.usercode import theirs

    factory = load_callable(spec, "lr_schedule")
    with theirs(f"the lr_schedule {spec}", factory):
        made = factory(optimizer)
    # ReduceLROnPlateau steps on a metric, not once per optimizer step.
    if not isinstance(made, LRScheduler) or isinstance(made, ReduceLROnPlateau):
        raise KilnError(f"lr_schedule {spec} returned {a_type(made)}; expected a "
                        "torch.optim.lr_scheduler scheduler stepped once per optimizer step "
                        "(e.g. LambdaLR, OneCycleLR, SequentialLR).")  # fmt: skip
    return made
