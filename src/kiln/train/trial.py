"""One probe of the training tuner, in a process of its own: `python -m kiln.train.trial JOB.json`.

The job (written by kiln.train.tuning) names the model, data, loss and optimizer — each a
`module:function` or a pickle file — a TrainConfig, the optimizer steps to take and how many of
them are warm-up. The child trains them with `kiln.train.fit` from the config's seed and prints
one JSON line, marked with `MARK`, as its last line of output:

    {"ok": true, "samples_per_s": ..., "step_s": [...], "loss": [...], "peak_mib": {...},
     "train_peak_mib": {...}, "global_batch": ...}

or {"ok": false, "error": "one line"} for a KilnError. Running each trial in its own process
is what lets the parent's watchdog kill an over-memory trial (and its ranks) without dying.
"""

from __future__ import annotations

import json
import pickle
import statistics
import sys
from pathlib import Path
from typing import Any

from kiln.errors import KilnError

MARK = "kiln-trial "  # the result line's prefix: the user's code may print too


class Seeded:
    """A model factory that seeds PyTorch first, so every trial (and every rank, which calls
    the factory itself) starts from the same initial weights. Picklable: it crosses to ranks."""

    def __init__(self, factory: Any, seed: int) -> None:
        self.factory, self.seed = factory, seed
        # Errors name the user's function, not this wrapper (kiln.compress.loading.spec_of).
        self.__module__ = getattr(factory, "__module__", None) or __name__
        self.__qualname__ = getattr(factory, "__qualname__", type(factory).__name__)

    def __call__(self) -> Any:
        import torch

        if isinstance(self.factory, torch.nn.Module):  # a pickled model: its weights are set
            return self.factory
        torch.manual_seed(self.seed)
        return self.factory()


def steady(step_s: list[float], warmup: int) -> list[float]:
    """The seconds of each optimizer step after the first `warmup` (compilation, the
    allocator's first growth, the loader's start): `fit` records the time since the loop
    began at each step."""
    durations = [b - a for a, b in zip([0.0, *step_s], step_s, strict=False)]
    return durations[warmup:]


def summarize(record: dict[str, Any], warmup: int) -> dict[str, Any]:
    """What the parent needs from a training record: steady-state speed, memory, the loss."""
    seconds = steady(record["step_seconds"], warmup)
    batch = record["global_batch"]
    return {
        "ok": True,
        "samples_per_s": batch / statistics.mean(seconds) if seconds else 0.0,
        "step_s": seconds,
        "loss": record["loss"],
        "peak_mib": record["peak_mib"],
        "train_peak_mib": record["train_peak_mib"],
        "global_batch": batch,
        "skipped": record["scale"]["skipped"],
    }


def load(ref: dict[str, str] | None) -> Any:
    """A job's reference: {"spec": "module:function"} or {"pickle": path}; None stays None."""
    if ref is None:
        return None
    if "spec" in ref:
        from kiln.compress.loading import load_callable

        return load_callable(ref["spec"], "the trial's function")
    with open(ref["pickle"], "rb") as file:
        return pickle.load(file)


def run(job: dict[str, Any]) -> dict[str, Any]:
    from kiln.train.config import TrainConfig
    from kiln.train.loop import fit

    config = TrainConfig.from_json(job["config"])
    model = Seeded(load(job["model"]), config.seed)
    record = fit(model, load(job["data"]), loss=load(job.get("loss")),
                 optimizer=load(job.get("optimizer")), config=config, steps=job["steps"],
                 validate=False)  # fmt: skip
    return summarize(record, job["warmup"])


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m kiln.train.trial JOB.json", file=sys.stderr)
        return 2
    job = json.loads(Path(argv[0]).read_text())
    try:
        result = run(job)
    except KilnError as exc:
        result = {"ok": False, "error": " ".join(str(exc).splitlines())}
    sys.stdout.write(MARK + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
