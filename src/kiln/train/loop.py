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

import contextlib
import copy
import math
import os
import pickle
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kiln.errors import KilnError, a_type
from kiln.train import memory, schedule
from kiln.train.config import TrainConfig
from kiln.train.export import check_outputs, write
from kiln.train.metrics_log import MetricsLog
from kiln.train.phases import phase
from kiln.train.prepared import Prepared, batches, prepare
from kiln.train.usercode import checked_loss, defined_at, theirs

Progress = Callable[[dict[str, Any]], None]
CHECKPOINT_EVERY = 50  # optimizer steps between checkpoints, when a directory is given
DEFAULT_LR = 1e-3
DEFAULT_WEIGHT_DECAY = 0.01
WEIGHTS = "_weights"  # rank 0's record key for the trained weights (taken out by fit)
BEST = "best"  # the checkpoint directory's subdirectory for the lowest validation loss's step


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
    bounds = (("--steps", steps), ("--epochs", epochs), ("--time", seconds))
    given = [(flag, value) for flag, value in bounds if value is not None]
    if len(given) != 1:
        said = f" (given: {', '.join(flag for flag, _ in given)})" if given else ""
        raise KilnError("say how long to train with exactly one of --steps N, --epochs N or "
                        f"--time 10m{said}.")  # fmt: skip
    _check_counts(*given[0], checkpoint_every)
    run = Run(model, data, loss, optimizer, config.to_json(), steps, epochs, seconds,
              str(checkpoint) if checkpoint else None, resume, checkpoint_every,
              str(profile) if profile else None, validate,
              str(save) if save else None, str(export) if export else None,
              val_every=val_every, early_stop=early_stop,
              metrics=str(metrics) if metrics else None)  # fmt: skip
    _check_validation(val_every, early_stop)
    schedule.check_length(config, steps or epochs)
    check_outputs(save, export)  # before training, not after it
    if resume and not checkpoint:
        raise KilnError("--resume continues from a checkpoint directory: give --checkpoint DIR.")
    if checkpoint:
        from kiln.train.checkpoint import check_storage

        check_storage(checkpoint)  # before step 1, not at the first save
    if resume:
        _check_resume(str(checkpoint), config, steps, allow_config_change)
    ranks = config.parallel.ranks
    nodes = int(nnodes.split(":")[-1]) if nnodes.split(":")[-1].isdigit() else 0
    if nodes < 1 or ranks % nodes:
        raise KilnError(f"--nnodes {nnodes}: the {ranks} ranks must share out evenly over the "
                        "nodes (give N or MIN:MAX with ranks a multiple of MAX).")  # fmt: skip
    with _no_partial_left(run.checkpoint):
        if ranks == 1:
            return train_rank(run, progress)
        from kiln.train.launch import launch

        run.replica = isinstance(model, nn.Module)
        results = launch(train_rank, (run, _crossing(progress)), ranks // nodes, nnodes=nnodes,
                         rdzv_endpoint=rdzv_endpoint)  # fmt: skip
        if run.replica:  # the caller's module holds the trained weights, as in one process
            model.load_state_dict(results[0].pop(WEIGHTS))
        return merge(results)


@contextlib.contextmanager
def _no_partial_left(directory: str | None) -> Iterator[None]:
    """A run stopped (Ctrl-C, SIGTERM) or failed while a checkpoint was being written leaves
    it partial (`.step-N.partial`, never read): it is removed once every rank has ended."""
    try:
        yield
    except BaseException:
        for partial in Path(directory).glob(".step-*.partial") if directory else ():
            shutil.rmtree(partial, ignore_errors=True)
        raise


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
    module = _model(run.model)
    if run.replica:
        # Sent here by torch.multiprocessing, its tensors share storage with the caller's
        # module and every other rank's: updates would land on all of them.
        module = copy.deepcopy(module)
    train, val = _datasets(run.data)
    with theirs("reading the training data", train, run.data):
        example = _first_sample(train)
        inputs, targets = _collate_example(train, config.micro_batch)
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
    start_step, seen, extra = _resume(run, prepared)  # the scheduler exists: restored too
    watch = _Watch.made(run, prepared, val, len(loader), start_step, extra)
    memory.reset_peak()
    resident = memory.resident_mib()  # model, data and runtime: what training adds is above
    try:
        record = _loop(run, prepared, loader, loss_fn, (start_step, seen), total, progress,
                       watch)  # fmt: skip
    finally:
        watch.close()
    peak = memory.peak_mib()
    record["peak_mib"] = {str(prepared.dist.rank): peak}
    record["train_peak_mib"] = {str(prepared.dist.rank): max(0.0, peak - resident)}
    if run.validate and val is not None:
        with theirs("validation", prepared.model, run.model, val, run.data):
            record["val"] = _validate(prepared, val, loss_fn)
    else:
        record["val"] = None
    record["config"] = config.to_json()  # a budget policy as it was resolved
    record["written"] = write(prepared, run.save, run.export, inputs, template)
    if run.replica:
        weights = prepared.state_dict()  # every rank takes part: shards and stages gather
        if prepared.dist.is_main:
            record[WEIGHTS] = weights
    record["tokens_per_sample"] = _tokens(example)
    if record["tokens_per_sample"]:
        record["tokens_per_s"] = record["samples_per_s"] * record["tokens_per_sample"]
    if run.profile:
        tokens = record["tokens_per_sample"]
        record["profile"] = _profile(run, prepared, loader, loss_fn, tokens)
    from kiln.train import parallel

    parallel.teardown()
    return record


def _loop(run: Run, prepared: Prepared, loader: Any, loss_fn: Any, begin: tuple[int, int],
          total: int | None, progress: Progress | None,
          watch: _Watch) -> dict[str, Any]:  # fmt: skip
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
            saved, saved_at = _save(run, prepared, step, samples, watch.state()), step
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
        saved = _save(run, prepared, step, seen + (step - start) * config.global_batch,
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


@dataclass
class _Watch:
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
             extra: dict[str, Any]) -> _Watch:  # fmt: skip
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
            result = _validate(prepared, self.val, loss_fn)
        if prepared.dist.world > 1:  # a pipeline's figure is on its last stage only
            result = next((r for r in reversed(prepared.gather(result)) if r), None)
        if result is None:  # no whole micro-batch of validation data
            return False
        lower = result["loss"] < self.best
        if lower:
            self.best, self.best_step, self.since = result["loss"], step, 0
            if run.checkpoint:
                self.best_checkpoint = str(Path(run.checkpoint) / BEST / f"step-{step:08d}")
                _save(run, prepared, step, samples, self.state(), best=True)
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


def _model(model: Any) -> nn.Module:
    from kiln.compress.loading import call

    if isinstance(model, nn.Module):
        return model
    return call(model, "the model factory", nn.Module, "a torch.nn.Module")


def _datasets(data: Any) -> tuple[Any, Any]:
    from kiln.compress.loading import spec_of

    named = f"{spec_of(data)}'s dataset" if callable(data) else "the dataset"
    if callable(data) and not hasattr(data, "__getitem__"):
        from kiln.compress.loading import call

        data = call(data, "the dataset function", object, "a Dataset or {train, val}")
    if isinstance(data, dict):
        if "train" not in data:
            raise KilnError(
                f"the dataset dict has keys {sorted(data)}; expected 'train' (and 'val')."
            )
        return data["train"], data.get("val")
    if not hasattr(data, "__getitem__") or not hasattr(data, "__len__"):
        raise KilnError(
            f"{named} is {a_type(data)}; expected a map-style Dataset (__getitem__, "
            "__len__) of (input, target) pairs, or {'train', 'val'}: an IterableDataset "
            "cannot be sharded across ranks, shuffled or resumed at a step."
        )
    return data, None


def _first_sample(dataset: Any) -> Any:
    where = defined_at(dataset)
    where = f" ({where})" if where else ""
    if len(dataset) == 0:
        raise KilnError(f"the training dataset is empty{where}.")
    sample = dataset[0]
    if not isinstance(sample, tuple | list) or len(sample) != 2:
        raise KilnError(
            f"the dataset's samples are {type(sample).__name__}s; expected (input, target) "
            f"pairs, e.g. return x, y from __getitem__{where}."
        )
    for part, what in zip(sample, ("input", "target"), strict=True):
        if not isinstance(part, torch.Tensor | int | float):
            raise KilnError(f"the dataset's {what} is {a_type(part)}; expected a "
                            f"tensor or a number{where}.")  # fmt: skip
    return sample


def _collate_example(dataset: Any, micro_batch: int) -> tuple[Any, Any]:
    """One micro-batch, collated as the loader will: the pipeline traces its stages on it."""
    from torch.utils.data import default_collate

    count = min(micro_batch, len(dataset))
    if count < micro_batch:
        raise KilnError(
            f"the training dataset has {len(dataset)} samples, fewer than one micro_batch "
            f"({micro_batch}: --batch over the data-parallel ranks and --accumulation); lower "
            "--batch or raise --accumulation."
        )
    return default_collate([dataset[i] for i in range(count)])


def _tokens(sample: Any) -> int | None:
    """Tokens per sample where the input is a sequence of ids (an integer tensor, 1-D)."""
    x = sample[0]
    if isinstance(x, torch.Tensor) and not x.is_floating_point() and x.dim() == 1:
        return int(x.numel())
    return None


@torch.no_grad()
def _validate(prepared: Prepared, val: Any, loss_fn: Any) -> dict[str, float] | None:
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


def _crossing(progress: Progress | None) -> Progress | None:
    """`progress` where it can cross to the ranks (it pickles: a plain log line does, a live
    bar in this process does not), else None."""
    try:
        pickle.dumps(progress)
    except (pickle.PicklingError, TypeError, AttributeError):
        return None
    return progress


def _check_counts(flag: str, value: float, checkpoint_every: int) -> None:
    """A bound of zero or less would train nothing and look like success: refuse it."""
    if value <= 0:
        raise KilnError(f"{flag} {value:g}: give a length above 0.")
    if checkpoint_every < 1:
        raise KilnError(f"--checkpoint-every {checkpoint_every}: use at least 1.")


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


def _check_resume(directory: str, config: TrainConfig, steps: int | None, allow: bool) -> None:
    """Before any rank starts, from the newest checkpoint's record: refuse a resume with
    nothing left to train, or under a config that changes the data order or the math
    (kiln.train.config.RESUME_KEEPS) unless `allow`."""
    from kiln.train import checkpoint
    from kiln.train.config import resume_changes

    found = checkpoint.latest(directory)
    if found is None:
        raise KilnError(f"--resume: no checkpoint in {directory} to continue from.")
    step, saved = checkpoint.made_under(found)
    if steps is not None and step >= steps:
        raise KilnError(f"--resume: {found} is at step {step}, already at --steps {steps}: "
                        f"nothing to train; give --steps above {step}.")  # fmt: skip
    changes = resume_changes(TrainConfig.from_json(saved, str(found)), config) if saved else []
    length = checkpoint.schedule_steps(found)
    if length is not None and steps is not None and steps != length:
        changes.append(f"the {config.lr_schedule} schedule's length (--steps) {length} → {steps}")
    if changes and not allow:
        raise KilnError(f"--resume: {found} was made under another config ({'; '.join(changes)}"
                        "), so the run would not go on as it began; resume with its settings, "
                        "or add --allow-config-change to go on anyway.")  # fmt: skip


def _resume(run: Run, prepared: Prepared) -> tuple[int, int, dict[str, Any]]:
    """(step, samples taken over all ranks, its extra) of the checkpoint resumed from, its
    weights, optimizer, scaler, LR scheduler and this rank's random generators restored;
    (0, 0, {}) for a fresh run."""
    if not (run.resume and run.checkpoint):
        return 0, 0, {}
    from kiln.train import checkpoint

    found = checkpoint.latest(run.checkpoint)
    if found is None:
        raise KilnError(f"--resume: no checkpoint in {run.checkpoint} to continue from.")
    step, extra = checkpoint.load(found, prepared.model, prepared.optimizer)
    prepared.load_state(extra)
    ranks = extra.get("ranks") or []
    # Another number of ranks draws other numbers anyway: their generators stay as seeded.
    if len(ranks) == prepared.dist.world:
        checkpoint.set_rng_state(ranks[prepared.dist.rank])
    return step, int(extra.get("samples", step * prepared.config.global_batch)), extra


def _save(run: Run, prepared: Prepared, step: int, samples: int,
          validation: dict[str, Any] | None = None, best: bool = False) -> Path:  # fmt: skip
    """A checkpoint at `step`, after `samples` samples over all ranks: with the weights and
    optimizer, what a resumed run needs to go on as this one would have — the scaler, the
    data position, every rank's random generators (dropout, a dataset's own draws) and the
    `validation` state (the best loss so far). `best`: the one checkpoint in `BEST`."""
    from kiln.train import checkpoint

    assert run.checkpoint is not None
    extra = {**prepared.state(), "samples": samples, "validation": validation or {},
             "ranks": checkpoint.rank_states(checkpoint.rng_state())}  # fmt: skip
    directory = Path(run.checkpoint) / BEST if best else run.checkpoint
    return checkpoint.save(directory, step, prepared.model, prepared.optimizer, extra,
                           config=prepared.config.to_json(),
                           keep=1 if best else checkpoint.KEEP,
                           schedule_steps=prepared.schedule_steps)  # fmt: skip


def _replicas(config: TrainConfig) -> int:
    """How many ranks share out each batch's samples (a pipeline's stages read them all)."""
    return config.global_batch // (config.micro_batch * config.accumulation)


def _profile(run: Run, prepared: Prepared, loader: Any, loss_fn: Any,
             tokens_per_sample: int | None) -> dict[str, Any] | None:  # fmt: skip
    """A few more steps under the step profiler on every rank together (their collectives
    meet; exposed communication exists only then), each speed finding's advice timed against
    the settings in use, rank 0's written as the HTML report; None on the other ranks. A
    profile that fails is reported in the record, and the training's record is kept."""
    from kiln.train.profiling import diagnose, profile_steps, try_advice, write_report

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
        findings = try_advice(findings, one_step, _advised(prepared, one_step), prepared.model)
    except Exception as exc:  # the training is done and kept; only its profile failed
        return {"report": None, "error": f"{type(exc).__name__}: {exc}"}
    if not prepared.dist.is_main:
        return None
    assert run.profile is not None
    write_report(found, findings, run.profile)
    return {
        "report": run.profile,
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


def _advised(prepared: Prepared, one_step: Callable[[], None]) -> Callable[[dict], Any]:
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
