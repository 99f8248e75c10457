"""The step profiler on a `fit` job: a few more steps on every rank together, each speed
finding's advice timed, rank 0's profile written as the report."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kiln.train.phases import phase
from kiln.train.prepared import Prepared, batches
from kiln.train.profiling import diagnose, profile_steps, try_advice, write_report


def profile_job(path: str, prepared: Prepared, loader: Any, loss_fn: Any,
             tokens_per_sample: int | None) -> dict[str, Any] | None:  # fmt: skip
    """A few more steps under the step profiler on every rank together (their collectives
    meet; exposed communication exists only then), each speed finding's advice timed against
    the settings in use, rank 0's written as the HTML report; None on the other ranks. A
    profile that fails is reported in the record, and the training's record is kept."""

    stream = batches(loader)

    def one_step() -> None:
        for _ in range(prepared.config.accumulation):
            with phase("data"):
                inputs, targets = next(stream)
            prepared.train_step(inputs, targets, loss_fn)

    try:
        found = profile_steps(one_step, model=prepared.model,
                              precision=prepared.config.precision,
                              samples_per_step=prepared.config.global_batch,
                              tokens_per_step=tokens_per_sample and tokens_per_sample
                              * prepared.config.global_batch)  # fmt: skip
        found = _whole_job(found)
        # Every rank tries the same advice, in the same order: rank 0's findings.
        findings = _from_rank0(diagnose(found, prepared.config))
        findings = try_advice(findings, one_step, advised_step(prepared, one_step), prepared.model)
    except Exception as exc:  # the training is done and kept; only its profile failed
        return {"report": None, "error": f"{type(exc).__name__}: {exc}"}
    if not prepared.dist.is_main:
        return None
    write_report(found, findings, path)
    return {
        "report": path,
        **found.to_json(),
        "findings": [f.to_json() for f in findings],
    }


def _whole_job(found: Any) -> Any:
    """The profile with the job's FLOPs per step — each rank counts only its own share (its
    micro-batch, its stage) — and the rate and MFU from them, against the machine's peak,
    as the job's samples/s already are. One process: as it is."""
    import dataclasses

    import torch.distributed as torch_dist

    if not torch_dist.is_initialized() or torch_dist.get_world_size() == 1:
        return found
    total = torch.tensor(float(found.flops_per_step or 0), dtype=torch.float64)
    torch_dist.all_reduce(total)  # every rank, whatever its own count: the collective meets
    if not found.flops_per_step:
        return found
    flops = int(total.item())
    achieved = flops / found.step_ms / 1e6 if found.step_ms > 0 else None
    mfu = achieved / found.peak_gflops if achieved and found.peak_gflops else None
    return dataclasses.replace(found, flops_per_step=flops, achieved_gflops=achieved, mfu=mfu)


def _from_rank0(items: list[Any]) -> list[Any]:
    import torch.distributed as torch_dist

    if not torch_dist.is_initialized() or torch_dist.get_world_size() == 1:
        return items
    box = [items]
    torch_dist.broadcast_object_list(box, src=0)
    return box[0]


def advised_step(prepared: Prepared, one_step: Callable[[], None]) -> Callable[[dict], Any]:
    """`one_step` under a finding's changes where this run can switch to them between steps:
    the autocast precision (bf16 or fp32; fp16 needs a loss scaler the run may not have).
    None for everything else (a loader, a hook, an optimizer: another run's settings)."""

    def advised(changes: dict[str, Any]) -> Callable[[], None] | None:
        if set(changes) != {"precision"} or changes["precision"] not in ("bf16", "fp32"):
            return None
        changed = prepared.config.replace(**changes)

        def step() -> None:
            kept, prepared.config = prepared.config, changed
            try:
                one_step()
            finally:
                prepared.config = kept

        return step

    return advised
