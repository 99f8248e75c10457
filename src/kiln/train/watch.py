"""Between a run's optimizer steps: the metrics log, a validation every N steps, the lowest
validation loss so far and its checkpoint, and early stopping; `validate`, the mean loss (and
accuracy) over a whole validation set."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kiln.errors import KilnError
from kiln.train import resuming
from kiln.train.metrics_log import MetricsLog
from kiln.train.prepared import Prepared
from kiln.train.run import Run
from kiln.train.usercode import theirs


@dataclass
class Watch:
    """Between optimizer steps: the metrics log (on the rank that has the losses), the
    validations every `every` steps, the lowest validation loss so far and its checkpoint,
    and early stopping after `patience` validations in a row without a lower loss."""

    val: Any = None
    every: int | None = None
    patience: int | None = None
    log: MetricsLog | None = None
    best: float = math.inf
    best_step: int | None = None
    best_checkpoint: str | None = None
    since: int = 0  # validations since the loss was last lower
    results: list[dict[str, Any]] = field(default_factory=list)
    stopped: bool = False
    clock: float = field(default_factory=time.perf_counter)  # when this step began

    @classmethod
    def made(cls, run: Run, prepared: Prepared, val: Any, batches_per_epoch: int, start: int,
             extra: dict[str, Any]) -> Watch:  # fmt: skip
        """For this run; a resumed one goes on from the checkpoint's `extra` (its best)."""
        every = run.val_every
        if every is not None and val is None:
            raise KilnError("--val-every: the data has no validation set; return "
                            '{"train": ..., "val": ...} from the data function.')  # fmt: skip
        if every == "epoch":  # one pass over this rank's share of the training data
            every = max(1, batches_per_epoch // prepared.config.accumulation)
        dist = prepared.dist
        writer = dist.world - 1 if prepared.pipeline is not None else 0  # the last stage's
        log = MetricsLog(run.metrics, start) if run.metrics and dist.rank == writer else None
        kept = extra.get("validation") or {}
        return cls(val, every, run.early_stop, log, kept.get("best", math.inf),
                   kept.get("best_step"), kept.get("best_checkpoint"),
                   kept.get("since", 0))  # fmt: skip

    def due(self, step: int) -> bool:
        return self.every is not None and step % self.every == 0

    def log_step(self, step: int, loss: float, prepared: Prepared, seconds: float) -> None:
        """The step's line: its samples/s is over its own time (loading, forward, backward,
        optimizer), without the validation or checkpoint that may follow a step."""
        if self.log is None:
            return
        took = time.perf_counter() - self.clock
        rate = prepared.config.global_batch / took if took > 0 else 0.0
        self.log.step(step, loss, prepared.lr, prepared.grad_norm, rate, seconds)

    def validate(self, run: Run, prepared: Prepared, loss_fn: Any, step: int,
                 samples: int) -> bool:  # fmt: skip
        """Validate now (every rank: FSDP2 and a pipeline need them all); whether to stop."""
        with theirs("validation", prepared.model, run.model, self.val, run.data):
            result = validate(prepared, self.val, loss_fn)
        if prepared.dist.world > 1:  # a pipeline's figure is on its last stage only
            result = next((r for r in reversed(prepared.gather(result)) if r), None)
        if result is None:  # no whole micro-batch of validation data
            return False
        lower = result["loss"] < self.best
        if lower:
            self.best, self.best_step, self.since = result["loss"], step, 0
            if run.checkpoint:
                best = Path(run.checkpoint) / resuming.BEST / f"step-{step:08d}"
                self.best_checkpoint = str(best)
                resuming.save(run, prepared, step, samples, self.state(), best=True)
        else:
            self.since += 1
        self.results.append({"step": step, **result})
        if self.log is not None:
            self.log.validation(step, result, lower)
        self.stopped = self.patience is not None and self.since >= self.patience
        return self.stopped

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps, so that a resumed run compares with the same best."""
        return {"best": self.best, "best_step": self.best_step,
                "best_checkpoint": self.best_checkpoint, "since": self.since}  # fmt: skip

    def record(self) -> dict[str, Any]:
        best = None
        if self.best_step is not None:
            best = {"step": self.best_step, "loss": self.best, "checkpoint": self.best_checkpoint}
        return {"validations": self.results, "best": best, "stopped_early": self.stopped}

    def close(self) -> None:
        if self.log is not None:
            self.log.close()


@torch.no_grad()
def validate(prepared: Prepared, val: Any, loss_fn: Any) -> dict[str, float] | None:
    """Mean loss (and accuracy, for class or token targets) over the whole validation set,
    every rank over all of it (FSDP2's forward needs every rank)."""
    if prepared.pipeline is not None:
        return prepared.pipeline.evaluate(val, loss_fn, prepared.config.micro_batch)
    from torch.utils.data import DataLoader

    model = prepared.model
    model.eval()
    total, correct, count, seen = 0.0, 0, 0, 0
    for x, y in DataLoader(val, batch_size=prepared.config.micro_batch):
        with prepared.autocast():
            out = model(x)
        total += float(loss_fn(out, y)) * len(x)
        seen += len(x)
        if out.dim() >= 2 and not y.is_floating_point() and out.shape[:-1] == y.shape:
            correct += int((out.argmax(-1) == y).sum())
            count += y.numel()
    model.train()
    if not seen:
        return None
    return {"loss": total / seen, **({"accuracy": correct / count} if count else {})}
