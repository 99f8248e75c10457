"""What one `fit` is asked to do: `Run`, the record that crosses to every rank."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Progress = Callable[[dict[str, Any]], None]
CHECKPOINT_EVERY = 50  # optimizer steps between checkpoints, when a directory is given


@dataclass
class Run:
    """What one fit is asked to do (every field pickles: it crosses to the ranks)."""

    model: Any
    data: Any
    loss: Any = None
    optimizer: Any = None
    config: dict[str, Any] = field(default_factory=dict)
    steps: int | None = None
    epochs: float | None = None
    seconds: float | None = None
    checkpoint: str | None = None
    resume: bool = False
    checkpoint_every: int = CHECKPOINT_EVERY
    profile: str | None = None
    validate: bool = True
    save: str | None = None  # the trained weights (a plain state_dict) are written here
    export: str | None = None  # the trained model as .onnx or .pt2
    val_every: int | str | None = None  # validate every N optimizer steps, or "epoch"
    early_stop: int | None = None  # stop after this many validations without a lower loss
    metrics: str | None = None  # the directory of metrics.jsonl (and TensorBoard's events)
    # `model` is the caller's module sent to ranks in other processes: each rank trains a
    # copy of its own and rank 0 sends the trained weights back (see fit).
    replica: bool = False
