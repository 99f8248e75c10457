"""A training run's metrics written as they happen, into one directory: `metrics.jsonl`, a
line per optimizer step (step, loss, lr, grad_norm, samples_per_s, seconds) and one per
validation (step, val_loss, val_accuracy where there is one, best), each flushed when written;
and TensorBoard event files beside it where the `tensorboard` package is installed
(torch.utils.tensorboard; `tensorboard --logdir DIR`). One rank writes.

A resumed run appends, after dropping the lines of steps past the checkpoint it resumes
from (the interrupted run's, which the resumed run takes again).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kiln.errors import KilnError

JSONL = "metrics.jsonl"


class MetricsLog:
    """`step(...)` and `validation(...)` lines in `directory`; `close()` at the end."""

    def __init__(self, directory: str | Path, resumed_at: int = 0) -> None:
        self.directory = Path(directory)
        path = self.directory / JSONL
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            _drop_after(path, resumed_at)
            self._file = path.open("a", encoding="utf-8")
        except OSError as exc:
            problem = exc.strerror or str(exc)
            raise KilnError(
                f"--metrics {directory}: cannot write {JSONL} there ({problem}); "
                "choose another directory."
            ) from None
        self._board = _board(self.directory)

    def step(self, step: int, loss: float, lr: float | None, grad_norm: float | None,
             samples_per_s: float, seconds: float) -> None:  # fmt: skip
        self._write({"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                     "samples_per_s": samples_per_s, "seconds": seconds}, "train")  # fmt: skip

    def validation(self, step: int, result: dict[str, float], best: bool) -> None:
        line = {"step": step, **{f"val_{k}": v for k, v in result.items()}, "best": best}
        self._write(line, "val")
        if self._board is not None:  # validations are rare: shown without waiting
            self._board.flush()

    def close(self) -> None:
        self._file.close()
        if self._board is not None:
            self._board.close()

    def _write(self, line: dict[str, Any], group: str) -> None:
        # NaN and inf are not JSON: a step without a figure (an overflow) says null.
        line = {k: v if not isinstance(v, float) or math.isfinite(v) else None
                for k, v in line.items()}  # fmt: skip
        self._file.write(json.dumps(line) + "\n")
        self._file.flush()
        if self._board is None:
            return
        for key, value in line.items():
            # TensorBoard keeps each point's wall time itself: "seconds" would repeat it.
            if key not in ("step", "best", "seconds") and isinstance(value, int | float):
                self._board.add_scalar(f"{group}/{key.removeprefix('val_')}", value, line["step"])


def _board(directory: Path) -> Any:
    """A TensorBoard SummaryWriter into `directory`, or None without the tensorboard package."""
    import importlib.util

    if importlib.util.find_spec("tensorboard") is None:
        return None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(directory), flush_secs=10)


def _drop_after(path: Path, step: int) -> None:
    """Keep only the lines of steps up to `step`: a fresh run (0) starts the file anew."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text(encoding="utf-8").splitlines()
            if _step_of(line) <= step]  # fmt: skip
    path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")


def _step_of(line: str) -> float:
    try:
        return float(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return math.inf  # not a line of ours (cut short by a kill): dropped
