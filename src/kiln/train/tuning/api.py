"""`tune`: the fastest TrainConfig at a fixed global batch (see kiln.train.tuning)."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

from kiln.errors import KilnError
from kiln.train.config import TrainConfig
from kiln.train.tuning.confirm import CONFIRM_ROUNDS, confirmation
from kiln.train.tuning.job import Job
from kiln.train.tuning.library import remember, warm_queue
from kiln.train.tuning.probe import WARMUP_STEPS, Probe
from kiln.train.tuning.search import LOSS_TOLERANCE, Say, Search
from kiln.train.tuning.space import TrainSpace
from kiln.train.tuning.specs import inspect_model, spec_name, trial_ref
from kiln.train.tuning.study import best_trial, nothing_fit, open_study, study_name, trial_row

PROBE_STEPS = 20
TRIALS = 12


def tune(
    model: Any,
    data: Any,
    *,
    base: TrainConfig,
    global_batch: int,
    seconds: float | None = None,
    trials: int = TRIALS,
    loss: Any = None,
    optimizer: Any = None,
    max_memory_mib: float | None = None,
    target_loss: float | None = None,
    storage: str | None = None,
    study: str | None = None,
    probe_steps: int = PROBE_STEPS,
    progress: Say | None = None,
    output: str | os.PathLike | None = None,
    space: dict[str, list[Any]] | None = None,
    confirm_rounds: int = CONFIRM_ROUNDS,
    seed: int | None = None,
    warm_start: bool = True,
) -> dict[str, Any]:
    """Search TrainConfigs at `global_batch` (see kiln.train.tuning); the result:
    {"config": the pick, "base", "adopted", "verdict", "speedup": {"value", "low", "high"} or
    None, "trials": [{trial, params, config, samples_per_s, peak_mib, loss, state, reason}],
    "tolerance", "reference", "study", "storage", "warm_start", "library_id"}.

    `model`, `data`, `loss`, `optimizer` are `module:function` names or objects (functions
    by their importable name; anything else pickled to the trial processes). `space` narrows
    knobs to given values (the base's own always stays). With `output` the result is written
    there: `kiln.train.read_config(output)` reads the pick back."""
    from kiln.hardware import cpu_info
    from kiln.tune.storage import default_url

    _check(global_batch, seconds, trials, probe_steps, max_memory_mib, confirm_rounds, output)
    deadline = time.monotonic() + seconds if seconds else None
    base = at_batch(base, global_batch)
    given = {"model": model, "data": data, "loss": loss, "optimizer": optimizer}
    specs = {name: spec_name(value) for name, value in given.items()}
    with tempfile.TemporaryDirectory(prefix="kiln-train-tune-") as folder:
        refs = {name: trial_ref(value, name, Path(folder)) for name, value in given.items()}
        facts = inspect_model(model, base.seed)
        cpu = cpu_info()
        searched = TrainSpace.build(base, global_batch, cpu.logical_cores, cpu.features,
                                    facts["blocks"], space)  # fmt: skip
        job = Job(specs, searched, Probe(refs, probe_steps, Path(folder), max_memory_mib), "",
                  storage or default_url(), target_loss, trials, seconds, deadline,
                  facts["signature"], confirm_rounds, seed, warm_start)  # fmt: skip
        rest = {"base": base.to_json(), "steps": probe_steps, "space": searched.choices}
        job.study = study or study_name(specs, global_batch, job.objective, max_memory_mib, rest)
        result = run_job(job, progress or (lambda _m: None))
    if output is not None:
        from kiln.home import atomic_write_json

        atomic_write_json(Path(output), result)
    return result


def run_job(job: Job, say: Say) -> dict[str, Any]:
    """The trials, the pick, its confirmation, the library record: the result."""
    from kiln.tune.library import Library
    from kiln.tune.storage import safe_url

    minimize = job.target_loss is not None
    search = Search(open_study(job.url, job.study, minimize, job.trials, job.seed), job.space,
                    job.probe, job.target_loss, say)  # fmt: skip
    search.load()
    library = Library(job.url)
    warm = warm_queue(search, library, job.signature, job.objective, job.warm_start)

    def until() -> float | None:
        return None if job.deadline is None else job.deadline - job.keep_s(search.base_wall_s)

    search.run(job.trials, until)
    pick = best_trial(search.study, minimize)
    if pick is None:
        raise KilnError(_nothing_fit(search, job.study))
    chosen = job.space.config(dict(pick.params))
    gains = confirmation(search, chosen, job.deadline, job.confirm_rounds)
    config = chosen if gains["adopt"] else job.space.base
    params = pick.params if gains["adopt"] else job.space.base_params
    library_id = remember(library, job, params, config, gains, len(search.study.trials))
    return {
        "config": config.to_json(), "base": job.space.base.to_json(), "adopted": gains["adopt"],
        "verdict": gains["verdict"], "speedup": gains["speedup"],
        "confirmation": gains.get("runs"), "objective": job.objective,
        "global_batch": job.space.global_batch, "max_memory_mib": job.probe.cap_mib,
        "target_loss": job.target_loss, "probe_steps": job.probe.steps,
        "tolerance": LOSS_TOLERANCE, "reference": search.reference,
        "trials": [trial_row(t) for t in search.study.trials], "study": job.study,
        "storage": safe_url(job.url), "warm_start": warm, "library_id": library_id,
        "model": job.specs["model"], "data": job.specs["data"],
    }  # fmt: skip


def _nothing_fit(search: Search, name: str) -> str:
    rows = [trial_row(t) for t in search.study.trials if t.user_attrs.get("ran")]
    return nothing_fit(rows, search.probe.cap_mib, name)


def _check(global_batch: int, seconds: float | None, trials: int, probe_steps: int,
           max_memory_mib: float | None, confirm_rounds: int,
           output: str | os.PathLike | None) -> None:  # fmt: skip
    if global_batch < 1:
        raise KilnError(f"--batch {global_batch}: give the global batch, 1 or more.")
    if trials < 1:
        raise KilnError(f"--trials {trials}: give 1 or more.")
    if probe_steps < WARMUP_STEPS + 2:
        raise KilnError(f"--steps {probe_steps}: a trial needs at least {WARMUP_STEPS + 2} "
                        f"(the first {WARMUP_STEPS} are warm-up).")  # fmt: skip
    if seconds is not None and seconds <= 0:
        raise KilnError(f"--time {seconds:g}s: give a positive duration, e.g. --time 15m.")
    if max_memory_mib is not None and max_memory_mib <= 0:
        raise KilnError(f"--max-memory {max_memory_mib:g} MiB: give a positive size, e.g. 2GB.")
    if confirm_rounds < 2:
        raise KilnError(f"confirm_rounds {confirm_rounds}: the confirmation needs 2 or more.")
    if output is not None:
        from kiln.home import output_problem

        problem = output_problem(Path(output))
        if problem:
            raise KilnError(f"-o {output}: {problem}.")


def at_batch(base: TrainConfig, global_batch: int) -> TrainConfig:
    """The base with its micro_batch set so its global batch is `global_batch` (as kiln
    train --batch sets it)."""
    replicas = 1 if base.parallel.strategy == "pipeline" else base.parallel.ranks
    per_step = base.accumulation * replicas
    if global_batch % per_step:
        raise KilnError(f"--batch {global_batch} does not split into the base's accumulation "
                        f"{base.accumulation} × {replicas} rank(s): give a multiple of "
                        f"{per_step}.")  # fmt: skip
    return base.replace(micro_batch=global_batch // per_step)
