"""The training tuner's Optuna study: its name (the limits in it), the study itself on kiln
tune's storage, the best trial, and the trials as the result lists them."""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from kiln.train.tuning.memory_model import over_limit


def study_name(specs: dict[str, str | None], global_batch: int, objective: str,
               max_memory_mib: float | None, rest: dict[str, Any]) -> str:  # fmt: skip
    """`train-MODEL-DATA-bN-OBJECTIVE[-maxM MiB]-HARDWARE-DIGEST`: the limits are in the
    name, so a study measured under one limit never answers another; the digest covers the
    rest that changes a measure (the functions' full names, the base, the steps, the space)."""
    from kiln.tune.signature import hardware

    short = [(specs[k] or "").rpartition(":")[2].rpartition(".")[2] for k in ("model", "data")]
    limit = [f"max{max_memory_mib:g}MiB"] if max_memory_mib is not None else []
    digest = hashlib.sha256(json.dumps([specs, rest], sort_keys=True, default=str).encode())
    parts = ["train", *short, f"b{global_batch}", objective, *limit, hardware()["class"][:8],
             digest.hexdigest()[:8]]  # fmt: skip
    return "-".join(parts)


def open_study(url: str, name: str, minimize: bool, trials: int, seed: int | None) -> Any:
    """The study `name` on the storage at `url`, created or resumed with kiln tune's sampler
    (grouped: prefetching is searched only with loader workers)."""
    from kiln.tune.storage import create_study, optuna_storage

    storage = optuna_storage(url)  # first: it quiets Optuna's experimental-feature warnings
    return create_study(storage, name, ["minimize" if minimize else "maximize"], trials=trials,
                        seed=seed, group=True, clash=f"study '{name}' exists with another "
                        "objective; choose another --study.")  # fmt: skip


def best_trial(study: Any, minimize: bool) -> Any | None:
    """The best complete trial (the earliest of equals); None when none completed."""
    import optuna

    done = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
            if "duplicate_of" not in t.user_attrs]  # fmt: skip
    if not done:
        return None
    sign = 1 if minimize else -1
    return min(done, key=lambda t: (sign * t.value, t.number))


def trial_row(trial: Any) -> dict[str, Any]:
    """One trial as the result lists it."""
    attrs = trial.user_attrs
    measure = attrs.get("measure") or {}
    return {
        "trial": trial.number, "state": trial.state.name, "params": trial.params,
        "samples_per_s": measure.get("samples_per_s"), "peak_mib": measure.get("peak_mib"),
        "train_peak_mib": measure.get("train_peak_mib"), "loss": measure.get("loss"),
        "time_to_loss": measure.get("time_to_loss"), "reason": attrs.get("reason"),
        "duplicate_of": attrs.get("duplicate_of"), "ran": bool(attrs.get("ran")),
        "config": json.loads(attrs["key"]) if "key" in attrs else None,
    }  # fmt: skip


def nothing_fit(rows: list[dict[str, Any]], cap_mib: float | None, name: str) -> str:
    """Why no trial of study `name` qualified, from the trials that ran: what stopped them,
    counted (the memory cap, the time, a failure), and what to change."""
    if not rows:
        return (f"study '{name}': no trial ran within --time; give more --time (the study is "
                "kept and resumes).")  # fmt: skip
    over = [r for r in rows if (r["reason"] or "").startswith("over the memory")]
    late = [r for r in rows if (r["reason"] or "").startswith("out of time")]
    if len(late) == len(rows):
        return (f"no trial of study '{name}' finished within --time; give more --time or "
                "fewer --steps (the study is kept and resumes).")  # fmt: skip
    if over and cap_mib is not None and len(over) + len(late) == len(rows):
        least = min(r["peak_mib"] or math.inf for r in over)
        peak, cap = over_limit(least, cap_mib).split(" > ")
        causes = f"{len(over)} were stopped over it (the leanest at {peak})"
        fixes = "raise --max-memory or lower --batch"
        if late:
            causes += f", {len(late)} ran out of time"
            fixes = "raise --max-memory, lower --batch or give more --time"
        return (f"no configuration fit --max-memory {cap} in {len(rows)} trials of study "
                f"'{name}': {causes}; {fixes} (the study is kept and resumes).")  # fmt: skip
    return (f"no configuration trained in {len(rows)} trials of study '{name}' (first: "
            f"{rows[0]['reason']}); fix that, or run more --trials.")  # fmt: skip
