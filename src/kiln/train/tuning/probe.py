"""One trial: a TrainConfig trained for a few steps in a process of its own (`python -m
kiln.train.trial`) under the process-tree supervisor, and the figures the study keeps of it."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.runtime.process_tree import Watched, kill_tree, watch
from kiln.train.config import TrainConfig
from kiln.train.trial import MARK
from kiln.train.tuning.memory_model import over_limit

WARMUP_STEPS = 2  # steps left out of samples/s: compilation, first allocations, loader start


@dataclass
class Run:
    """One child run: how it ended, the tree's peak as the watchdog saw it, its line."""

    state: str  # "ok" | "over-memory" | "out-of-time" | "failed"
    reason: str | None
    peak_mib: float
    wall_s: float
    result: dict[str, Any] | None = None


@dataclass
class Probe:
    """What every child run of one tuning shares: the job's functions, steps and limits."""

    refs: dict[str, dict[str, str] | None]
    steps: int
    folder: Path
    cap_mib: float | None

    def run(self, config: TrainConfig, deadline: float | None) -> Run:
        stem = self.folder / f"job-{uuid.uuid4().hex[:8]}"
        job = {**self.refs, "config": config.to_json(), "steps": self.steps,
               "warmup": WARMUP_STEPS}  # fmt: skip
        Path(f"{stem}.json").write_text(json.dumps(job))
        with open(f"{stem}.out", "w") as out, open(f"{stem}.err", "w") as err:
            started = time.monotonic()
            # Its own session: the watchdog kills the child's whole process group, never ours.
            proc = subprocess.Popen(
                [sys.executable, "-m", "kiln.train.trial", f"{stem}.json"], stdout=out,
                stderr=err, env=_child_env(), start_new_session=True,
            )  # fmt: skip
            try:
                watched = watch(proc, self.cap_mib, deadline)
            except BaseException:  # Ctrl-C, SIGTERM, a bug: its own session hears no signal
                kill_tree(proc)
                raise
        wall = time.monotonic() - started
        why = _why_stopped(watched, self.cap_mib)
        if why is not None:
            state = "over-memory" if watched.killed == "memory" else "out-of-time"
            return Run(state, why, watched.peak_mib, wall)
        return _read(stem, proc.returncode, watched.peak_mib, wall)


def _why_stopped(watched: Watched, cap_mib: float | None) -> str | None:
    """Why the supervisor killed the trial's tree (None: it was not)."""
    if watched.killed == "memory" and cap_mib is not None:
        return f"over the memory limit: {over_limit(watched.at_mib, cap_mib)}"
    if watched.killed == "time":
        return "out of time: stopped where the time left for it ended"
    return None


def _read(stem: Path, returncode: int, peak: float, wall: float) -> Run:
    lines = Path(f"{stem}.out").read_text().splitlines()
    found = [line[len(MARK) :] for line in lines if line.startswith(MARK)]
    if found:
        result = json.loads(found[-1])
        if result.get("ok"):
            return Run("ok", None, peak, wall, result)
        return Run("failed", result.get("error"), peak, wall)
    errors = [line.strip() for line in Path(f"{stem}.err").read_text().splitlines()
              if line.strip()]  # fmt: skip
    last = errors[-1] if errors else "no output"
    return Run("failed", f"the trial process ended with code {returncode}: {last}", peak, wall)


def _child_env() -> dict[str, str]:
    """The child imports what this process can: the user's modules beside them, a test's
    helpers."""
    paths = [os.path.abspath(p or os.getcwd()) for p in sys.path]
    paths = [p for p in dict.fromkeys(paths) if os.path.isdir(p)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def tail_loss(losses: list[float]) -> float | None:
    """The mean training loss over the last third of the steps (finite ones)."""
    tail = [v for v in losses[-max(1, len(losses) // 3) :] if math.isfinite(v)]
    return statistics.mean(tail) if tail else None


def figures(run: Run, target_loss: float | None) -> dict[str, Any]:
    """A measured run as the study keeps it. Its peak is the larger of the watchdog's and the
    ranks' own high-water marks (a spike after the last poll)."""
    result = run.result or {}
    losses = result["loss"]
    ranks = result["peak_mib"]
    step_s = statistics.median(result["step_s"]) if result["step_s"] else math.nan
    reached = None
    if target_loss is not None:
        reached = next((i + 1 for i, v in enumerate(losses) if v <= target_loss), None)
    return {
        "samples_per_s": result["samples_per_s"],
        "peak_mib": max(run.peak_mib, *ranks.values()),
        "rank_peak_mib": ranks,
        "train_peak_mib": result["train_peak_mib"],
        "loss": tail_loss(losses),
        "loss_curve": losses,
        "step_s": result["step_s"],
        # steps to the target × the steady step: compilation is not charged to a long run
        "time_to_loss": reached * step_s if reached else None,
        "wall_s": run.wall_s,
    }
