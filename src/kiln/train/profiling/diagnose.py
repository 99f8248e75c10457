"""The bottlenecks of a step profile, one small rule each — data-bound, exposed
communication, fp32 matmuls where bf16 kernels exist, optimizer-bound, activations holding
the peak memory — each with its evidence and the TrainConfig change that addresses it, said
as `kiln train` flags or its --config JSON."""

from __future__ import annotations

import json
import math
from typing import Any

from kiln.profile.finding import Finding, nested
from kiln.train.config import TrainConfig
from kiln.train.profiling.record import StepProfile

DATA_BOUND = 0.20  # of the step waiting for the next batch
EXPOSED_COMM = 0.10  # of the step in collectives no compute hides
FP32_MATMULS = 0.20  # of the (profiled) step in fp32 matrix products
OPTIMIZER_BOUND = 0.25  # of the step in the optimizer
ACTIVATIONS = 0.50  # of the peak memory held by activations
# Of the device's memory: below this share memory limits neither the batch nor the model, and
# trading compute for memory (checkpointing) only slows the step.
MEMORY_TIGHT = 0.50
UNEVEN = 1.5  # slowest batch over the mean: prefetch more to ride out the slow ones
# TrainConfig fields that `kiln train` takes as flags; the rest go in its --config JSON
CLI_FLAGS = {"precision": "--precision", "checkpointing.policy": "--checkpointing"}


def diagnose(profile: StepProfile, config: TrainConfig | None = None) -> list[Finding]:
    """The bottlenecks of a profile: those of time, largest share of the step first, then
    those of memory (a share of the peak is not a share of the step). `config` (the run's
    TrainConfig) lets the advice start from the settings in use; without it, the defaults."""
    base = config or TrainConfig()
    rules = (_data_bound, _exposed_comm, _fp32_matmuls, _optimizer_bound, _activations)
    found = [f for rule in rules if (f := rule(profile, base)) is not None]
    return sorted(found, key=lambda f: (f.time_ms is None, -f.share))


def _finding(kind: str, title: str, share: float, time_ms: float | None, evidence: str,
             fix: str, settings: dict[str, Any]) -> Finding:  # fmt: skip
    action = f"{fix}: {how(settings)}"
    return Finding(kind, title, share, time_ms, evidence, action, settings=settings)


def how(settings: dict[str, Any]) -> str:
    """The settings as `kiln train` flags where it has them, the rest as its --config JSON."""
    flags = " ".join(f"{CLI_FLAGS[k]} {v}" for k, v in settings.items() if k in CLI_FLAGS)
    rest = {k: v for k, v in settings.items() if k not in CLI_FLAGS}
    config = f"--config with {json.dumps(nested(rest))}" if rest else ""
    return " ".join(part for part in ("kiln train …", flags, config) if part)


def _data_bound(p: StepProfile, base: TrainConfig) -> Finding | None:
    share = p.share("data")
    if share < DATA_BOUND:
        return None
    data, rest = p.split_ms["data"], max(p.step_ms - p.split_ms["data"], 1e-3)
    now = base.loader.workers
    # a batch's making: the wait itself in-process; with N workers keeping the step waiting,
    # N batches per step's time
    making = data if now == 0 else now * p.step_ms
    needed = math.ceil(making / rest)  # workers that keep pace with the rest of the step
    spare = max(p.cores - 1, 1)  # one core stays with the training process
    workers = max(min(needed, spare), 1, now)  # never fewer than now
    slowest = max(s["data"] for s in p.steps)
    prefetch = 4 if slowest > UNEVEN * data else 2  # uneven batches: more in flight
    evidence = (
        f"the step waits {data:.1f} ms for its batch ({share:.0%} of {p.step_ms:.1f} ms); "
        f"loading runs in {_in_workers(now)}; the slowest batch took {slowest:.1f} ms"
    )
    fix = (
        f"load batches in {workers} worker process{'es' * (workers > 1)} while the step "
        f"computes ({p.cores} cores: cores − 1 = {spare}), {prefetch} batches ahead each"
    )
    if needed > workers:
        fix += (f"; keeping pace needs ~{needed} workers, more than the cores spare: make "
                "__getitem__ cheaper too (decode or tokenize once, ahead of training)")  # fmt: skip
    settings = {"loader.workers": workers, "loader.prefetch_factor": prefetch}
    return _finding("data-bound", "data-bound: the step waits for batches", share, data,
                    evidence, fix, settings)  # fmt: skip


def _in_workers(workers: int) -> str:
    return "the training process (loader.workers 0)" if workers == 0 else f"{workers} workers"


def _exposed_comm(p: StepProfile, base: TrainConfig) -> Finding | None:
    comm = p.communication
    share = p.share("communication")
    if share < EXPOSED_COMM:
        return None
    where = max(comm["by_phase_ms"], key=comm["by_phase_ms"].get)
    names = ", ".join(sorted(comm["collectives"])) or "collectives"
    evidence = (
        f"{p.split_ms['communication']:.1f} ms per step ({share:.0%}) in {names} with no "
        f"compute beside it, mostly in {where}; {comm['overlapped_ms']:.1f} ms overlapped (a "
        "wait for a slower rank counts as exposed too)"
    )
    if base.parallel.strategy == "pipeline":
        # Stages wait on each other's sends for (stages − 1) of (microbatches + stages − 1)
        # slots of a GPipe-style schedule: more microbatches shrink that bubble.
        now = base.parallel.microbatches
        more = next((n for n in range(now + 1, base.micro_batch + 1) if base.micro_batch % n == 0),
                    None)  # fmt: skip
        settings: dict[str, Any] = {"parallel.microbatches": more} if more else {}
        fix = (f"more microbatches ({more}, now {now}) shrink the schedule's bubble, where a "
               "stage waits on its neighbour's sends" if more else
               f"a larger micro-batch, cut into more than {now} microbatches, shrinks the "
               "schedule's bubble, where a stage waits on its neighbour's sends")  # fmt: skip
    elif base.parallel.strategy == "fsdp2":
        settings = {"parallel.reduce_dtype": "bf16"}
        fix = "reduce-scatter gradients in bf16 (half the bytes)"
    else:
        bucket = max(round(base.parallel.bucket_mb / 2, 1), 1.0)
        settings = {"parallel.bucket_mb": bucket, "parallel.comm_hook": "bf16"}
        fix = (f"smaller gradient buckets ({bucket:g} MB, now {base.parallel.bucket_mb:g}) start "
               "their all-reduce earlier in backward; a bf16 hook halves the bytes")  # fmt: skip
    return _finding("exposed-communication", "exposed communication", share,
                    p.split_ms["communication"], evidence, fix, settings)  # fmt: skip


def _fp32_matmuls(p: StepProfile, _base: TrainConfig) -> Finding | None:
    fp32 = p.matmuls.get("fp32")
    if p.precision != "fp32" or not p.bf16_kernels or not fp32 or p.profiled_step_ms <= 0:
        return None
    on_cpu = p.device == "cpu"
    calls = sum(m["calls"] for m in p.matmuls.values()) or 1
    share = fp32["ms"] / p.profiled_step_ms if on_cpu else fp32["calls"] / calls
    if share < FP32_MATMULS:
        return None
    spent = (f"{fp32['ms']:.1f} ms of a {p.profiled_step_ms:.1f} ms profiled step ({share:.0%})"
             if on_cpu else f"{share:.0%} of the matmul calls")  # fmt: skip
    evidence = f"{fp32['calls']:.0f} fp32 matmuls per step take {spent}; this machine has " + (
        f"bf16 kernels ({', '.join(p.bf16_kernels)})"
    )
    if p.peaks.get("bf16"):
        evidence += f": bf16 GEMM peak {p.peaks['bf16']:.0f} vs fp32 {p.peaks['fp32']:.0f} GFLOP/s"
    time_ms = share * p.step_ms
    return _finding("fp32-matmuls", "fp32 matmuls where bf16 kernels exist", share, time_ms,
                    evidence, "autocast the matmuls to bf16", {"precision": "bf16"})  # fmt: skip


def _optimizer_bound(p: StepProfile, _base: TrainConfig) -> Finding | None:
    share = p.share("optimizer")
    if share < OPTIMIZER_BOUND or p.optimizer == "fused":
        return None
    how = {"foreach": "foreach (a few ops per group of tensors)",
           "for-loop": "a for-loop (several ops per parameter tensor)"}  # fmt: skip
    evidence = (f"the optimizer takes {p.split_ms['optimizer']:.1f} ms ({share:.0%} of the "
                f"step), run as {how.get(p.optimizer or '', 'unknown ops')}")  # fmt: skip
    fix = (
        "one fused kernel over all parameters (Adam, AdamW, SGD, Adagrad; for others foreach: true)"
    )
    return _finding("optimizer-bound", "optimizer-bound", share, p.split_ms["optimizer"],
                    evidence, fix, {"fused": True, "foreach": None})  # fmt: skip


def _activations(p: StepProfile, base: TrainConfig) -> Finding | None:
    memory = p.memory
    if memory.get("source") != "categories" or not memory.get("peak_mib"):
        return None
    held = memory["at_peak_mib"]
    share = held["activations"] / memory["peak_mib"]
    tight = memory["peak_mib"] >= MEMORY_TIGHT * memory["device_mib"]
    if not tight or share < ACTIVATIONS or base.checkpointing.policy == "full":
        return None
    others = ", ".join(f"{k} {v:.0f}" for k, v in held.items() if k != "activations")
    evidence = (f"activations hold {held['activations']:.0f} MiB of the {memory['peak_mib']:.0f} "
                f"MiB peak ({share:.0%}; {others} MiB); the peak is "
                f"{memory['peak_mib'] / memory['device_mib']:.1%} of the {memory['device']}'s "
                f"{memory['device_mib'] / 1024:.0f} GiB")  # fmt: skip
    fix = (
        "where memory limits the batch or the model: recompute activations in backward "
        "instead of keeping them (about one more forward per step; policy every for half "
        "the saving at half the cost)"
    )
    return _finding("memory-activations", "activations dominate the peak memory", share, None,
                    evidence, fix, {"checkpointing.policy": "full"})  # fmt: skip
