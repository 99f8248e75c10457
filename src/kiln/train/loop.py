"""`fit`: Kiln's own training loop for users without one — a model factory, a dataset, a loss,
an optimizer and a TrainConfig in; a trained model's checkpoint and a training record out.

    record = fit(make_model, make_data, config=TrainConfig(precision="bf16"), steps=200)

`model` is an nn.Module or a function that returns one; `data` a map-style Dataset of (input,
target) pairs, a dict with "train" and "val", or a function returning either; `loss` defaults
to cross-entropy (flattened over all but the last dim, so a language model's [B, T, V] logits
work), `optimizer` to AdamW(lr=1e-3, weight_decay=0.01), a function of the parameters. With
`nproc > 1` the ranks are started through torchrun's launcher (kiln.train.launch) and every
argument must pickle: module-level functions, modules, datasets.

The loop marks its phases for the step profiler (kiln.train.phases): data, forward, backward,
optimizer. Where it stops (steps, epochs or a deadline) all ranks agree: rank 0 decides and
tells the others, so no rank waits forever in a collective the others left.
"""

from __future__ import annotations

import copy
import math
import os
import pickle
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kiln.errors import KilnError
from kiln.runtime import footprint
from kiln.train import memory, resuming, schedule
from kiln.train.config import TrainConfig
from kiln.train.export import check_outputs, write
from kiln.train.inputs import (
    collate_example,
    datasets,
    first_sample,
    model_of,
    tokens_per_sample,
)
from kiln.train.phases import phase
from kiln.train.prepared import Prepared, batches, prepare
from kiln.train.run import CHECKPOINT_EVERY, Progress, Run
from kiln.train.usercode import checked_loss, theirs
from kiln.train.watch import Watch, validate

DEFAULT_LR = 1e-3
DEFAULT_WEIGHT_DECAY = 0.01
WEIGHTS = "_weights"  # rank 0's record key for the trained weights (taken out by fit)


def fit(
    model: Any,
    data: Any,
    *,
    loss: Any = None,
    optimizer: Any = None,
    config: TrainConfig | None = None,
    steps: int | None = None,
    epochs: float | None = None,
    seconds: float | None = None,
    checkpoint: str | Path | None = None,
    resume: bool = False,
    allow_config_change: bool = False,
    checkpoint_every: int = CHECKPOINT_EVERY,
    profile: str | Path | None = None,
    validate: bool = True,
    save: str | Path | None = None,
    export: str | Path | None = None,
    val_every: int | str | None = None,
    early_stop: int | None = None,
    metrics: str | Path | None = None,
    progress: Progress | None = None,
    nnodes: str = "1",
    rdzv_endpoint: str | None = None,
) -> dict[str, Any]:
    """Train; the training record (see `train_rank` for its fields). Exactly one of `steps`
    (optimizer steps), `epochs` or `seconds` bounds the run. Several machines: `nnodes`
    (torchrun's "N" or "MIN:MAX") and the `rdzv_endpoint` host:port all of them meet at; the
    config's ranks are then the whole world, shared out evenly over the nodes.

    The trained model: a module instance given as `model` holds the trained weights
    afterwards; `save` writes them as a plain state_dict (torch.save), `export` the model as
    ONNX (.onnx: `kiln optimize`, `kiln serve`) or a torch.export program (.pt2), traced on
    one batch of the training inputs with a dynamic batch dim; a `checkpoint` directory
    loads into a fresh module with `kiln.train.load(directory, module)`.

    `val_every` validates on the data's "val" set every N optimizer steps, or each epoch
    ("epoch"), during training; with a `checkpoint` directory the step of the lowest
    validation loss is kept in its `best/`, and `early_stop` stops the run after that many
    validations in a row without a lower loss. `metrics` is a directory the run writes its
    metrics into as they happen (kiln.train.metrics_log: metrics.jsonl, and TensorBoard's
    event files where tensorboard is installed).

    `resume` goes on from the newest checkpoint in `checkpoint` as the run that wrote it
    would have (the same samples, dropout and augmentation draws), under the config it was
    made with: one that changes the data order or the math (config.RESUME_KEEPS) is refused
    unless `allow_config_change`."""
    config = config or TrainConfig()
    _check_length(steps, epochs, seconds, checkpoint_every)
    run = Run(model, data, loss, optimizer, config.to_json(), steps, epochs, seconds,
              str(checkpoint) if checkpoint else None, resume, checkpoint_every,
              str(profile) if profile else None, validate,
              str(save) if save else None, str(export) if export else None,
              val_every=val_every, early_stop=early_stop,
              metrics=str(metrics) if metrics else None)  # fmt: skip
    _check_validation(val_every, early_stop)
    schedule.check_length(config, steps or epochs)
    check_outputs(save, export)  # before training, not after it
    if checkpoint:
        from kiln.train.checkpoint import check_storage

        check_storage(checkpoint)  # before step 1, not at the first save
    if resume:
        resuming.check(checkpoint, config, steps, allow_config_change)
    ranks = config.parallel.ranks
    nodes = _nodes(nnodes, ranks)
    with resuming.no_partial_left(run.checkpoint):
        if ranks == 1:
            return train_rank(run, progress)
        from kiln.train.launch import launch

        run.replica = isinstance(model, nn.Module)
        results = launch(train_rank, (run, _crossing(progress)), ranks // nodes, nnodes=nnodes,
                         rdzv_endpoint=rdzv_endpoint)  # fmt: skip
        if run.replica:  # the caller's module holds the trained weights, as in one process
            model.load_state_dict(results[0].pop(WEIGHTS))
        return merge(results)


def merge(results: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's record (the last stage's losses for a pipeline) with every rank's peak."""
    record = dict(results[0])
    # A pipeline's losses exist on its last stage only (NaN on the others).
    with_loss = [r for r in results.values() if any(math.isfinite(v) for v in r.get("loss", []))]
    if with_loss and with_loss[-1] is not results[0]:
        source = with_loss[-1]
        for key in ("loss", "final_loss", "val"):
            record[key] = source.get(key)
    for key in ("peak_mib", "train_peak_mib"):
        record[key] = {str(rank): r[key][str(rank)] for rank, r in results.items()}
    return record


# ------------------------------------------------------------------------------ one rank


def train_rank(run: Run, progress: Progress | None = None) -> dict[str, Any]:
    """The loop on this rank; its record: config, global_batch, steps, samples, seconds,
    samples_per_s, tokens_per_s (sequence inputs), loss per optimizer step, final_loss, val
    ({"loss", "accuracy"}), scale (events, skipped, final), step_seconds (since the loop began,
    at each step), peak_mib {rank: MiB} (the process's resident peak) and train_peak_mib (the
    part above what was resident when the loop began: activations, gradients, optimizer
    state), checkpoint, validations (each {step, loss, accuracy}: with `val_every`), best
    ({step, loss, checkpoint} of the lowest validation loss) and stopped_early."""
    config = TrainConfig.from_json(run.config)
    module = model_of(run.model)
    if run.replica:
        # Sent here by torch.multiprocessing, its tensors share storage with the caller's
        # module and every other rank's: updates would land on all of them.
        module = copy.deepcopy(module)
    train, val = datasets(run.data)
    with theirs("reading the training data", train, run.data):
        example = first_sample(train)
        inputs, targets = collate_example(train, config.micro_batch)
    # The loss runs as the user's code; where it fails on the targets, the data is named.
    loss_fn = checked_loss(run.loss if run.loss is not None else cross_entropy, train, run.data)
    if config.checkpointing.policy == "budget":
        config = budget_policy(module, (inputs, targets), loss_fn, config)
    # FSDP2 shards the module in place: an export traces a plain copy taken before.
    template = copy.deepcopy(module) if run.export and config.parallel.strategy == "fsdp2" else None
    prepared = prepare(module, run.optimizer or adamw, config, loss_fn=loss_fn, example=inputs)
    loader = prepared.loader(train)
    total = _total_steps(run, len(loader), config)
    if schedule.needs_length(config):
        prepared.schedule(total)  # the decay spreads over the run's steps
    start_step, seen, extra = resuming.restore(run, prepared)  # the scheduler exists: restored too
    watch = Watch.made(run, prepared, val, len(loader), start_step, extra)
    footprint.reset_peak()
    resident = footprint.rss_mib()  # model, data and runtime: what training adds is above
    try:
        record = _loop(run, prepared, loader, loss_fn, (start_step, seen), total, progress,
                       watch)  # fmt: skip
    finally:
        watch.close()
    peak = footprint.peak_rss_mib()
    record["peak_mib"] = {str(prepared.dist.rank): peak}
    record["train_peak_mib"] = {str(prepared.dist.rank): max(0.0, peak - resident)}
    if run.validate and val is not None:
        with theirs("validation", prepared.model, run.model, val, run.data):
            record["val"] = validate(prepared, val, loss_fn)
    else:
        record["val"] = None
    record["config"] = config.to_json()  # a budget policy as it was resolved
    record["written"] = write(prepared, run.save, run.export, inputs, template)
    if run.replica:
        weights = prepared.state_dict()  # every rank takes part: shards and stages gather
        if prepared.dist.is_main:
            record[WEIGHTS] = weights
    record["tokens_per_sample"] = tokens_per_sample(example)
    if record["tokens_per_sample"]:
        record["tokens_per_s"] = record["samples_per_s"] * record["tokens_per_sample"]
    if run.profile:
        from kiln.train.profiling.job import profile_job

        tokens = record["tokens_per_sample"]
        record["profile"] = profile_job(run.profile, prepared, loader, loss_fn, tokens)
    from kiln.train import parallel

    parallel.teardown()
    return record


def _loop(run: Run, prepared: Prepared, loader: Any, loss_fn: Any, begin: tuple[int, int],
          total: int | None, progress: Progress | None,
          watch: Watch) -> dict[str, Any]:  # fmt: skip
    """Optimizer steps from `begin` (the step and the samples taken before it, over all
    ranks) until `_stop` or `watch` stops it early; the record of this run."""
    config, dist = prepared.config, prepared.dist
    start, seen = begin
    if total is not None and start >= total:  # --epochs; --steps is checked before the ranks
        raise KilnError(f"--resume: the checkpoint is at step {start}, already at the {total} "
                        f"steps of --epochs {run.epochs:g}: nothing to train; give more "
                        "--epochs.")  # fmt: skip
    # A resumed run goes on with the samples the interrupted one had not reached: the same
    # shuffles (the loader's generator is seeded), positioned past what it took.
    loader.seek(seen // _replicas(config))
    stream = batches(loader)
    losses: list[float] = []
    times: list[float] = []  # seconds since the loop started, at each optimizer step
    deadline = time.monotonic() + run.seconds if run.seconds else None
    step, started, saved, saved_at = start, time.perf_counter(), None, start
    watch.clock = started
    micro_losses: list[float] = []
    while not _stop(step, total, deadline, dist):
        with phase("data"), theirs("loading a training batch", run.data):
            inputs, targets = next(stream)
        with theirs("the training step", prepared.model, run.model):
            value = prepared.train_step(inputs, targets, loss_fn)
        if value is not None:
            micro_losses.append(float(value.detach()))
        if prepared._micro != 0:  # the optimizer step waits for more micro-batches
            continue
        step += 1
        mean = sum(micro_losses) / len(micro_losses) if micro_losses else math.nan
        micro_losses = []
        _check_loss(mean, step, start, prepared)
        losses.append(mean)
        times.append(time.perf_counter() - started)
        samples = seen + (step - start) * config.global_batch
        watch.log_step(step, mean, prepared, times[-1])
        stopping = watch.due(step) and watch.validate(run, prepared, loss_fn, step, samples)
        if run.checkpoint and step % run.checkpoint_every == 0:
            saved, saved_at = resuming.save(run, prepared, step, samples, watch.state()), step
        if progress is not None and dist.rank == 0:  # one report for the job
            elapsed = time.perf_counter() - started
            progress({"step": step, "steps": total, "loss": mean, "seconds": elapsed,
                      "samples_per_s": (step - start) * config.global_batch / elapsed,
                      "loss_scale": prepared.loss_scale})  # fmt: skip
        if stopping:  # every rank agrees: the validation loss is the same on all of them
            break
        watch.clock = time.perf_counter()  # the next step's samples/s leaves out the above
    seconds = time.perf_counter() - started
    if run.checkpoint and step > saved_at:  # the last step, unless just saved
        saved = resuming.save(run, prepared, step, seen + (step - start) * config.global_batch,
                      watch.state())  # fmt: skip
    done = step - start
    return {
        "config": config.to_json(),
        "global_batch": config.global_batch,
        "steps": step,
        "steps_this_run": done,
        "samples": done * config.global_batch,
        "seconds": seconds,
        "samples_per_s": done * config.global_batch / seconds if seconds > 0 else 0.0,
        "loss": losses,
        "step_seconds": times,
        "final_loss": _tail_mean(losses),
        "scale": {
            "events": [asdict(e) for e in prepared.scale_events],
            "skipped": prepared.skipped,
            "final": prepared.loss_scale,
        },  # fmt: skip
        "checkpoint": str(saved) if saved else None,
        **watch.record(),
        **_made_with(dist),
    }


def _made_with(dist: Any) -> dict[str, Any]:
    """The software and machine a run was made with, for the record that reproduces it."""
    import platform
    import socket

    import kiln
    from kiln.hardware import cpu_info

    gpu = torch.cuda.get_device_name(dist.device) if dist.device.type == "cuda" else None
    return {
        "versions": {"kiln": kiln.__version__, "torch": torch.__version__,
                     "python": platform.python_version()},
        "host": {"name": socket.gethostname(), "platform": platform.platform(),
                 "cpu": cpu_info().model, "cores": os.cpu_count(), "gpu": gpu},
    }  # fmt: skip


def budget_policy(module: nn.Module, batch: tuple[Any, Any], loss_fn: Any,
                  config: TrainConfig) -> TrainConfig:  # fmt: skip
    """`checkpointing.policy budget` resolved from two measured probes — one training step
    (forward, backward, AdamW) of a copy of the model without checkpointing and one with every
    block checkpointed — into the sparsest `every` policy whose predicted peak above the
    resident baseline (train_peak_mib) is under `checkpointing.budget_mib`."""
    import copy

    if config.parallel.ranks > 1:
        raise KilnError("checkpointing.policy budget is probed in one process: with "
                        "several ranks choose full or every (kiln train --tune measures "
                        "them).")  # fmt: skip
    blocks = memory.chosen_blocks(module, config.checkpointing)
    memory.give_back_large_frees()  # probes measure live memory, not the allocator's keep
    peaks = []
    for policy in ("none", "full"):
        probe = copy.deepcopy(module)
        memory.apply_checkpointing(probe, memory.chosen_blocks(probe, config.checkpointing)
                                   if policy == "full" else [])  # fmt: skip
        optimizer = adamw(probe.parameters())

        def step(model: nn.Module = probe, opt: Any = optimizer) -> None:
            with precision_context(config, next(model.parameters()).device):
                loss = loss_fn(model(batch[0]), batch[1])
            loss.backward()
            opt.step()

        peaks.append(memory.measure_peak(step))
        del probe, optimizer
    budget = config.checkpointing.budget_mib
    assert budget is not None
    chosen = memory.blocks_for_budget(blocks, peaks[0], peaks[1], budget)
    if not chosen:
        return config.replace(checkpointing={"policy": "none"})
    every = max(1, len(blocks) // len(chosen))
    return config.replace(checkpointing={"policy": "full" if every == 1 else "every",
                                         "every": every})  # fmt: skip


def precision_context(config: TrainConfig, device: torch.device) -> Any:
    from kiln.train.precision import autocast

    return autocast(config, device)


def _stop(step: int, total: int | None, deadline: float | None, dist: Any) -> bool:
    """Whether to stop before this step; rank 0's answer on every rank."""
    stop = (total is not None and step >= total) or (
        deadline is not None and time.monotonic() >= deadline
    )
    if dist.world > 1 and deadline is not None:  # clocks differ: one rank decides
        flag = torch.tensor([1.0 if stop else 0.0])
        torch.distributed.broadcast(flag, src=0)
        stop = bool(flag.item())
    return stop


def _check_loss(mean: float, step: int, start: int, prepared: Prepared) -> None:
    """A loss that is not finite: fp16 skips such steps (the scaler backs off), except on the
    very first, where nothing has been learnt that could have diverged; fp32/bf16 stop."""
    if math.isfinite(mean) or (math.isnan(mean) and prepared.pipeline is not None):
        return
    if step == start + 1 or prepared.config.precision != "fp16":
        fp16 = prepared.config.precision == "fp16"
        raise KilnError(
            f"the loss is {mean} at step {step}{' (the first)' if step == start + 1 else ''}: "
            "check the loss function, the learning rate and the data (NaN or inf inputs)"
            + ("; fp16 overflows here would need precision bf16 or a lower "
               "loss_scale.initial." if fp16 else ".")
        )  # fmt: skip


def _tail_mean(losses: list[float]) -> float | None:
    tail = [v for v in losses[-max(1, len(losses) // 10) :] if math.isfinite(v)]
    return sum(tail) / len(tail) if tail else None


def _total_steps(run: Run, batches_per_epoch: int, config: TrainConfig) -> int | None:
    if run.steps:
        return run.steps
    if run.epochs:
        return max(1, int(run.epochs * batches_per_epoch / config.accumulation))
    return None


# ------------------------------------------------------------------------------ pieces


def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over all but the last dim: [B, C] classes or [B, T, V] tokens."""
    if output.dim() > 2:
        return nn.functional.cross_entropy(output.reshape(-1, output.shape[-1]).float(),
                                           target.reshape(-1))  # fmt: skip
    return nn.functional.cross_entropy(output.float(), target)


def adamw(params: Any) -> torch.optim.Optimizer:
    """The default optimizer: AdamW, lr 1e-3, weight decay 0.01."""
    return torch.optim.AdamW(params, lr=DEFAULT_LR, weight_decay=DEFAULT_WEIGHT_DECAY)


def _crossing(progress: Progress | None) -> Progress | None:
    """`progress` where it can cross to the ranks (it pickles: a plain log line does, a live
    bar in this process does not), else None."""
    try:
        pickle.dumps(progress)
    except (pickle.PicklingError, TypeError, AttributeError):
        return None
    return progress


def _check_length(steps: int | None, epochs: float | None, seconds: float | None,
                  checkpoint_every: int) -> None:  # fmt: skip
    """Exactly one bound, above zero: a bound of zero or less would train nothing and look
    like success."""
    bounds = (("--steps", steps), ("--epochs", epochs), ("--time", seconds))
    given = [(flag, value) for flag, value in bounds if value is not None]
    if len(given) != 1:
        said = f" (given: {', '.join(flag for flag, _ in given)})" if given else ""
        raise KilnError("say how long to train with exactly one of --steps N, --epochs N or "
                        f"--time 10m{said}.")  # fmt: skip
    flag, value = given[0]
    if value <= 0:
        raise KilnError(f"{flag} {value:g}: give a length above 0.")
    if checkpoint_every < 1:
        raise KilnError(f"--checkpoint-every {checkpoint_every}: use at least 1.")


def _nodes(nnodes: str, ranks: int) -> int:
    """The most nodes torchrun's "N" or "MIN:MAX" allows; the ranks must share out evenly."""
    nodes = int(nnodes.split(":")[-1]) if nnodes.split(":")[-1].isdigit() else 0
    if nodes < 1 or ranks % nodes:
        raise KilnError(f"--nnodes {nnodes}: the {ranks} ranks must share out evenly over the "
                        "nodes (give N or MIN:MAX with ranks a multiple of MAX).")  # fmt: skip
    return nodes


def _check_validation(val_every: int | str | None, early_stop: int | None) -> None:
    steps = isinstance(val_every, int) and not isinstance(val_every, bool) and val_every >= 1
    if val_every not in (None, "epoch") and not steps:
        raise KilnError(f"--val-every {val_every}: give a number of optimizer steps ≥ 1, or "
                        "epoch.")  # fmt: skip
    if early_stop is not None:
        if not isinstance(early_stop, int) or early_stop < 1:
            raise KilnError(f"--early-stop {early_stop}: give a number of validations ≥ 1.")
        if val_every is None:
            raise KilnError("--early-stop counts validations: give --val-every N (optimizer "
                            "steps) or --val-every epoch.")  # fmt: skip


def _replicas(config: TrainConfig) -> int:
    """How many ranks share out each batch's samples (a pipeline's stages read them all)."""
    return config.global_batch // (config.micro_batch * config.accumulation)
