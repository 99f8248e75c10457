"""`TrainConfig`: every decision Kiln makes about one training run, as data.

What `kiln.train.prepare` and `kiln.train.fit` take, what the training record keeps, what
`kiln train --config train.json` and `kiln.train.read_config(path)` read back, and the search
space of the training tuner — as `CompileConfig` is for inference. Grouped as torchtitan groups
its job config: precision, memory, parallelism and the loader are sections of one record.

The global batch is `micro_batch × accumulation × ranks` (`TrainConfig.global_batch`); the tuner
trades its factors but never changes the product.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.errors import KilnError

PRECISIONS = ("fp32", "bf16", "fp16")
CHECKPOINTING = ("none", "full", "every", "selective", "budget")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
STRATEGIES = ("single", "ddp", "fsdp2", "pipeline")
COMM_HOOKS = ("none", "bf16", "fp16")
SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b")
DTYPES = ("fp32", "bf16", "fp16")
LR_SCHEDULES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class LossScale:
    """The dynamic loss scaler of fp16 (torch.amp.GradScaler's knobs): the scale starts at
    `initial`, is multiplied by `backoff` on a step whose gradients overflow (that step is
    skipped) and by `growth` after `interval` clean steps in a row."""

    initial: float = 2.0**16
    growth: float = 2.0
    backoff: float = 0.5
    interval: int = 2000

    def check(self) -> None:
        if self.initial <= 0 or self.growth <= 1 or not 0 < self.backoff < 1:
            raise KilnError(
                f"loss_scale {self.initial:g}/{self.growth:g}/{self.backoff:g}: the scale must "
                "be > 0, growth > 1 and backoff in (0, 1), e.g. 65536, 2, 0.5."
            )
        _at_least(self.interval, 1, "loss_scale.interval")


@dataclass(frozen=True)
class Checkpointing:
    """Activation checkpointing (recompute in backward instead of keeping activations).

    policy   none | full (every block) | every (every `every`-th block) | selective (blocks of
             the module types in `modules`) | budget (the fewest blocks that keep the peak
             under `budget_mib`, from a measured probe)
    A block is a child of the model's repeated container (an nn.ModuleList or nn.Sequential
    of like modules: a transformer's layers), found by kiln.train.memory."""

    policy: str = "none"
    """Activation checkpointing: none; full (every block); every (every `every`-th block, 2
    unless told); selective (blocks of the module types in `modules`); budget (the fewest
    blocks that keep the peak under `budget_mib`, from a measured probe)."""
    every: int = 2
    modules: tuple[str, ...] = ()
    budget_mib: float | None = None

    def check(self) -> None:
        _one_of(self.policy, CHECKPOINTING, "checkpointing.policy")
        _at_least(self.every, 1, "checkpointing.every")
        if self.policy == "selective" and not self.modules:
            raise KilnError(
                "checkpointing.policy selective: name the module types to recompute in "
                'checkpointing.modules, e.g. ["TransformerEncoderLayer"].'
            )
        if self.policy == "budget" and (self.budget_mib is None or self.budget_mib <= 0):
            raise KilnError("checkpointing.policy budget: give checkpointing.budget_mib > 0.")


@dataclass(frozen=True)
class Parallel:
    """How ranks share the work (torch.distributed; ranks started by torchrun).

    strategy          single | ddp | fsdp2 | pipeline
    ranks             processes (gloo on CPUs, NCCL on GPUs); threads_per_rank: torch threads
                      in each (None: the machine's cores ÷ ranks)
    ddp               bucket_mb, gradient_as_bucket_view, static_graph, comm_hook (none | bf16 |
                      fp16: gradients compressed for the all-reduce)
    fsdp2             reshard_after_forward; param_dtype / reduce_dtype (its mixed-precision
                      policy; None: the parameters' own)
    pipeline          stages (= ranks), schedule (gpipe | 1f1b | interleaved1f1b) and
                      microbatches per step
    """

    strategy: str = "single"
    """single, ddp, fsdp2 or pipeline (several ranks: give --nproc)."""
    ranks: int = 1
    threads_per_rank: int | None = None
    bucket_mb: float = 25.0
    gradient_as_bucket_view: bool = True
    static_graph: bool = False
    comm_hook: str = "none"
    reshard_after_forward: bool = True
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    schedule: str = "1f1b"
    microbatches: int = 4

    def check(self) -> None:
        _one_of(self.strategy, STRATEGIES, "parallel.strategy")
        _one_of(self.comm_hook, COMM_HOOKS, "parallel.comm_hook")
        _one_of(self.schedule, SCHEDULES, "parallel.schedule")
        _at_least(self.ranks, 1, "parallel.ranks")
        _at_least(self.microbatches, 1, "parallel.microbatches")
        if self.threads_per_rank is not None:
            _at_least(self.threads_per_rank, 1, "parallel.threads_per_rank")
        if self.bucket_mb <= 0:
            raise KilnError(f"parallel.bucket_mb {self.bucket_mb:g}: give a size > 0 (MB).")
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None:
                _one_of(value, DTYPES, f"parallel.{name}")
        if self.strategy == "single" and self.ranks > 1:
            raise KilnError(
                f"parallel.ranks {self.ranks} with strategy single: choose ddp, fsdp2 or "
                "pipeline to use several ranks."
            )
        if self.strategy == "pipeline" and self.ranks < 2:
            raise KilnError("parallel.strategy pipeline needs at least 2 ranks (one per stage).")

    @property
    def stages(self) -> int:
        """Pipeline stages: one per rank."""
        return self.ranks


@dataclass(frozen=True)
class Loader:
    """The DataLoader: `workers` processes (0: in the training process), `prefetch_factor`
    batches each keeps ready (None: PyTorch's 2 where workers > 0), `pin_memory`,
    `persistent_workers` (kept between epochs), `shuffle`, `drop_last`."""

    workers: int = 0
    prefetch_factor: int | None = None
    pin_memory: bool = False
    persistent_workers: bool = False
    shuffle: bool = True
    drop_last: bool = True

    def check(self) -> None:
        _at_least(self.workers, 0, "loader.workers")
        if self.prefetch_factor is not None:
            _at_least(self.prefetch_factor, 1, "loader.prefetch_factor")
            if self.workers == 0:
                raise KilnError(
                    "loader.prefetch_factor needs loader.workers > 0 (PyTorch prefetches "
                    "only in worker processes)."
                )
        if self.persistent_workers and self.workers == 0:
            raise KilnError("loader.persistent_workers needs loader.workers > 0.")


@dataclass(frozen=True)
class TrainConfig:
    """How a model is trained; every field a decision (see the module docstring), its
    docstring what it means (and the help of the `kiln train` flag that sets it)."""

    precision: str = "fp32"
    """fp32, bf16 (autocast) or fp16 (autocast + the dynamic loss scaling of `loss_scale`)."""
    loss_scale: LossScale = field(default_factory=LossScale)
    """fp16's dynamic loss scaler (see LossScale)."""
    keep_fp32: tuple[str, ...] = ()
    """Module type names (e.g. "LayerNorm") or qualified names ("head") run in fp32 under
    autocast."""
    micro_batch: int = 32
    """Samples per forward."""
    accumulation: int = 1
    """Micro-batches per optimizer step."""
    clip_grad_norm: float | None = None
    """Clip the gradients' global norm to this (the record keeps the norm); None: no
    clipping."""
    lr_schedule: str = "constant"
    """The learning rate over the run, as a fraction of the optimizer's own: constant, linear
    or cosine (decay to 0 over the run's steps), or module:fn(optimizer) -> LRScheduler of
    your own."""
    warmup: int = 0
    """Optimizer steps over which the learning rate first rises linearly to its own."""
    checkpointing: Checkpointing = field(default_factory=Checkpointing)
    """Activation checkpointing (see Checkpointing)."""
    compile: str | None = None
    """None (eager) or a torch.compile mode, e.g. "default"."""
    foreach: bool | None = None
    """The optimizer's foreach implementation (None: PyTorch's choice)."""
    fused: bool | None = None
    """The optimizer's fused implementation (None: PyTorch's choice)."""
    set_to_none: bool = True
    """zero_grad(set_to_none=...)."""
    parallel: Parallel = field(default_factory=Parallel)
    """Strategy, ranks and threads (see Parallel)."""
    loader: Loader = field(default_factory=Loader)
    """The DataLoader's settings (see Loader)."""
    seed: int = 0
    """For the model's initialisation order, the sampler and dropout."""

    def __post_init__(self) -> None:
        _one_of(self.precision, PRECISIONS, "precision")
        _at_least(self.micro_batch, 1, "micro_batch")
        _at_least(self.accumulation, 1, "accumulation")
        if self.clip_grad_norm is not None and self.clip_grad_norm <= 0:
            raise KilnError(f"clip_grad_norm {self.clip_grad_norm:g}: give a norm > 0 or None.")
        _check_schedule(self.lr_schedule, self.warmup)
        if self.compile is not None:
            _one_of(self.compile, COMPILE_MODES, "compile")
        if self.foreach and self.fused:
            raise KilnError("foreach and fused are two optimizer implementations: pick one.")
        object.__setattr__(self, "keep_fp32", tuple(self.keep_fp32))
        for name, kind in _SECTIONS.items():  # a section may be given as a dict of its fields
            section = _section(kind, getattr(self, name), name)
            object.__setattr__(self, name, section)
            section.check()
        if self.parallel.strategy == "pipeline" and self.micro_batch % self.parallel.microbatches:
            raise KilnError(
                f"micro_batch {self.micro_batch} does not split into parallel.microbatches "
                f"{self.parallel.microbatches}: make it a multiple."
            )

    @property
    def global_batch(self) -> int:
        """Samples per optimizer step, over every rank. A pipeline's ranks hold stages of one
        model, not replicas: they share the batch rather than multiply it."""
        replicas = 1 if self.parallel.strategy == "pipeline" else self.parallel.ranks
        return self.micro_batch * self.accumulation * replicas

    def threads(self, cores: int | None = None) -> int:
        """torch threads for each rank: the given number; else OMP_NUM_THREADS where the user
        set it (PyTorch's own loop honours it: overriding it would run threads the user kept
        for other work); else the cores shared out."""
        if self.parallel.threads_per_rank is not None:
            return self.parallel.threads_per_rank
        asked = os.environ.get("OMP_NUM_THREADS", "").strip()
        if asked.isdigit() and int(asked) > 0:
            return int(asked)
        cores = cores or os.cpu_count() or 1
        return max(1, cores // self.parallel.ranks)

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with fields changed; a section may be given as a dict of its own changes,
        e.g. replace(parallel={"strategy": "ddp", "ranks": 2})."""
        for name, kind in _SECTIONS.items():
            if isinstance(changes.get(name), Mapping):
                changes[name] = _section(kind, {**dataclasses.asdict(getattr(self, name)),
                                                **changes[name]}, name)  # fmt: skip
        return dataclasses.replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["keep_fp32"] = list(self.keep_fp32)
        data["checkpointing"]["modules"] = list(self.checkpointing.modules)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str = "config") -> TrainConfig:
        if not isinstance(data, Mapping):
            raise KilnError(f"{where}: a TrainConfig is a JSON object.")
        fields = dict(data)
        _no_unknown(cls, fields, where, "TrainConfig")
        for name, kind in _SECTIONS.items():
            if name in fields:
                fields[name] = _section(kind, fields[name], f"{where}: {name}")
        if "keep_fp32" in fields:
            fields["keep_fp32"] = _names(fields["keep_fp32"], f"{where}: keep_fp32")
        try:
            return cls(**fields)
        except TypeError as exc:
            raise KilnError(f"{where}: not a valid TrainConfig ({exc}).") from None


_SECTIONS: dict[str, type] = {
    "loss_scale": LossScale,
    "checkpointing": Checkpointing,
    "parallel": Parallel,
    "loader": Loader,
}


# What a resumed run must share with the checkpoint it continues: these decide which samples
# each step sees and what the step computes. How the work is spread — strategy, ranks, the
# micro-batch × accumulation split of the global batch, compile, activation checkpointing,
# the loader's workers — may change between runs.
RESUME_KEEPS = ("global_batch", "precision", "loss_scale", "keep_fp32", "clip_grad_norm",
                "lr_schedule", "warmup", "seed", "loader.shuffle", "loader.drop_last")  # fmt: skip


def resume_changes(saved: TrainConfig, now: TrainConfig) -> list[str]:
    """The settings of RESUME_KEEPS that differ between a checkpoint's config and the run
    resuming from it, each as "name before → now" (the loss scale only where fp16 uses it)."""
    changes = []
    for name in RESUME_KEEPS:
        if name == "loss_scale" and "fp16" not in (saved.precision, now.precision):
            continue
        before, after = _field(saved, name), _field(now, name)
        if before != after:
            changes.append(f"{name} {_shown(before)} → {_shown(after)}")
    return changes


def _field(config: TrainConfig, name: str) -> Any:
    value: Any = config
    for part in name.split("."):
        value = getattr(value, part)
    return value


def _shown(value: Any) -> str:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return json.dumps(dataclasses.asdict(value))
    return json.dumps(list(value)) if isinstance(value, tuple) else str(value)


def read_config(path: str | os.PathLike) -> TrainConfig:
    """A TrainConfig from a JSON file: a bare config, or a file `kiln train --tune` or a
    training record wrote (its "config")."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise KilnError(f"{path}: no such training config.") from None
    except OSError as exc:
        raise KilnError(f"{path}: cannot read the config ({exc.strerror or exc}).") from None
    except ValueError as exc:
        raise KilnError(f"{path}: not JSON ({exc}).") from None
    if isinstance(data, dict) and isinstance(data.get("config"), dict):
        return TrainConfig.from_json(data["config"], f"{path} (config)")
    return TrainConfig.from_json(data, str(path))


# The training record's keys for the functions given as --loss and --optimizer (its "loss"
# is the loss at each step).
RECORDED_FUNCTIONS = {"loss": "loss_function", "optimizer": "optimizer"}


def recorded_functions(path: str | os.PathLike) -> dict[str, str]:
    """The --loss and --optimizer (module:function) a training record was made with, so that
    `--config record.json` trains as that run did; {} for a bare config, and for defaults."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}  # read_config says what is wrong with the file
    if not isinstance(data, dict) or not isinstance(data.get("config"), dict):
        return {}
    found = {flag: data.get(key) for flag, key in RECORDED_FUNCTIONS.items()}
    return {flag: spec for flag, spec in found.items() if isinstance(spec, str)}


def _section(kind: type, data: Any, where: str) -> Any:
    if isinstance(data, kind):
        return data
    if not isinstance(data, Mapping):
        raise KilnError(f"{where}: expected a JSON object of {kind.__name__} fields.")
    fields = dict(data)
    _no_unknown(kind, fields, where, kind.__name__)
    if kind is Checkpointing and "modules" in fields:
        fields["modules"] = _names(fields["modules"], f"{where}.modules")
    try:
        return kind(**fields)
    except TypeError as exc:
        raise KilnError(f"{where}: not a valid {kind.__name__} ({exc}).") from None


def _no_unknown(kind: type, fields: Mapping[str, Any], where: str, what: str) -> None:
    known = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise KilnError(
            f"{where}: unknown {what} field '{unknown[0]}'; the fields are "
            f"{', '.join(sorted(known))}."
        )


def _names(value: Any, where: str) -> tuple[str, ...]:
    if isinstance(value, str) or not all(isinstance(v, str) for v in value or ()):
        raise KilnError(f'{where}: expected a list of names, e.g. ["LayerNorm"].')
    return tuple(value)


def _check_schedule(schedule: Any, warmup: Any) -> None:
    """A named schedule, or a user's scheduler (module:fn) with its warm-up built in."""
    if not isinstance(schedule, str) or (":" not in schedule and schedule not in LR_SCHEDULES):
        raise KilnError(f"lr_schedule '{schedule}': use one of {', '.join(LR_SCHEDULES)}, "
                        "or module:fn, a function of the optimizer returning an "
                        "LRScheduler.")  # fmt: skip
    _at_least(warmup, 0, "warmup")
    if ":" in schedule and warmup:
        raise KilnError(f"warmup {warmup} with lr_schedule {schedule}: a scheduler of your own "
                        "does its own warm-up (e.g. torch's LinearLR in a SequentialLR); set "
                        "warmup 0.")  # fmt: skip


def _one_of(value: Any, allowed: tuple[str, ...], name: str) -> None:
    if value not in allowed:
        raise KilnError(f"{name} '{value}': use one of {', '.join(allowed)}.")


def _at_least(value: Any, low: int, name: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise KilnError(f"{name} {value!r}: use a whole number ≥ {low}.")
