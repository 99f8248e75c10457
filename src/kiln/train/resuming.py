"""A run's checkpoints: each written with what a resumed run needs to go on as this one would
have, a resume checked before any rank starts, the newest restored, and a partial one (a run
stopped while writing it) removed."""

from __future__ import annotations

import contextlib
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kiln.errors import KilnError
from kiln.train.config import TrainConfig
from kiln.train.prepared import Prepared
from kiln.train.run import Run

BEST = "best"  # the checkpoint directory's subdirectory for the lowest validation loss's step


@contextlib.contextmanager
def no_partial_left(directory: str | None) -> Iterator[None]:
    """A run stopped (Ctrl-C, SIGTERM) or failed while a checkpoint was being written leaves
    it partial (`.step-N.partial`, never read): it is removed once every rank has ended."""
    try:
        yield
    except BaseException:
        for partial in Path(directory).glob(".step-*.partial") if directory else ():
            shutil.rmtree(partial, ignore_errors=True)
        raise


def check(directory: str | Path | None, config: TrainConfig, steps: int | None,
          allow: bool) -> None:  # fmt: skip
    """Before any rank starts, from the newest checkpoint's record: refuse a resume without
    a checkpoint directory, with nothing left to train, or under a config that changes the
    data order or the math (kiln.train.config.RESUME_KEEPS) unless `allow`."""
    if not directory:
        raise KilnError("--resume continues from a checkpoint directory: give --checkpoint DIR.")
    directory = str(directory)
    from kiln.train import checkpoint
    from kiln.train.config import resume_changes

    found = checkpoint.latest(directory)
    if found is None:
        raise KilnError(f"--resume: no checkpoint in {directory} to continue from.")
    step, saved = checkpoint.made_under(found)
    if steps is not None and step >= steps:
        raise KilnError(f"--resume: {found} is at step {step}, already at --steps {steps}: "
                        f"nothing to train; give --steps above {step}.")  # fmt: skip
    changes = resume_changes(TrainConfig.from_json(saved, str(found)), config) if saved else []
    length = checkpoint.schedule_steps(found)
    if length is not None and steps is not None and steps != length:
        changes.append(f"the {config.lr_schedule} schedule's length (--steps) {length} → {steps}")
    if changes and not allow:
        raise KilnError(f"--resume: {found} was made under another config ({'; '.join(changes)}"
                        "), so the run would not go on as it began; resume with its settings, "
                        "or add --allow-config-change to go on anyway.")  # fmt: skip


def restore(run: Run, prepared: Prepared) -> tuple[int, int, dict[str, Any]]:
    """(step, samples taken over all ranks, its extra) of the checkpoint resumed from, its
    weights, optimizer, scaler, LR scheduler and this rank's random generators restored;
    (0, 0, {}) for a fresh run."""
    if not (run.resume and run.checkpoint):
        return 0, 0, {}
    from kiln.train import checkpoint

    found = checkpoint.latest(run.checkpoint)
    if found is None:
        raise KilnError(f"--resume: no checkpoint in {run.checkpoint} to continue from.")
    step, extra = checkpoint.load(found, prepared.model, prepared.optimizer)
    prepared.load_state(extra)
    ranks = extra.get("ranks") or []
    # Another number of ranks draws other numbers anyway: their generators stay as seeded.
    if len(ranks) == prepared.dist.world:
        checkpoint.set_rng_state(ranks[prepared.dist.rank])
    return step, int(extra.get("samples", step * prepared.config.global_batch)), extra


def save(run: Run, prepared: Prepared, step: int, samples: int,
          validation: dict[str, Any] | None = None, best: bool = False) -> Path:  # fmt: skip
    """A checkpoint at `step`, after `samples` samples over all ranks: with the weights and
    optimizer, what a resumed run needs to go on as this one would have — the scaler, the
    data position, every rank's random generators (dropout, a dataset's own draws) and the
    `validation` state (the best loss so far). `best`: the one checkpoint in `BEST`."""
    from kiln.train import checkpoint

    assert run.checkpoint is not None
    extra = {**prepared.state(), "samples": samples, "validation": validation or {},
             "ranks": checkpoint.rank_states(checkpoint.rng_state())}  # fmt: skip
    directory = Path(run.checkpoint) / BEST if best else run.checkpoint
    return checkpoint.save(directory, step, prepared.model, prepared.optimizer, extra,
                           config=prepared.config.to_json(),
                           keep=1 if best else checkpoint.KEEP,
                           schedule_steps=prepared.schedule_steps)  # fmt: skip
