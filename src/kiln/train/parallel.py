"""The distributed layer: join the ranks torchrun started, and wrap the model for the strategy
in `TrainConfig.parallel` — DDP, FSDP2 (`fully_shard`) or a pipeline of stages
(`torch.distributed.pipelining`). Kiln only chooses and configures; PyTorch does the work.

    dist = setup(config)                       # rank, world, device, backend
    model = wrap(model, config, dist)          # single / ddp / fsdp2
    with no_sync(model):                       # accumulation micro-steps
        ...
    runner = pipeline(model, config, dist, loss_fn, example_inputs)   # strategy pipeline
    loss = runner.step(inputs, targets)        # the mean loss on the last stage, else None
    teardown()
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as torch_dist
from torch import nn
from torch.distributed import pipelining
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel

from kiln.errors import KilnError
from kiln.train.config import Parallel, TrainConfig
from kiln.train.memory import find_blocks

# How long a rank waits for its peers (joining, and in any one collective) before it fails:
# a missing or dead peer ends the job instead of hanging it.
GROUP_TIMEOUT_S = 60.0

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_COMM_HOOKS = {"bf16": default_hooks.bf16_compress_hook, "fp16": default_hooks.fp16_compress_hook}
_SCHEDULES: dict[str, type] = {
    "gpipe": pipelining.ScheduleGPipe,
    "1f1b": pipelining.Schedule1F1B,
    "interleaved1f1b": pipelining.ScheduleInterleaved1F1B,
}
# Stages each rank holds, per schedule: interleaving gives each rank two (virtual) stages.
_STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1, "interleaved1f1b": 2}

_made_group = False  # whether `setup` created the process group (and `teardown` ends it)
# The DDP wrappers `wrap` made, for `teardown` (see _release_reducers).
_ddp_models: weakref.WeakSet[DistributedDataParallel] = weakref.WeakSet()


@dataclass
class Dist:
    """This process's place in the job."""

    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str  # "gloo" (CPU), "nccl" (CUDA), "none" (a world of 1 without a group)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(config: TrainConfig) -> Dist:
    """Join the process group torchrun set up (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT in the environment) and set this rank's torch threads.

    A world of 1 has no group, except for ddp and fsdp2, which get a one-rank group so the
    wrapped model (and its checkpoints) are of the same kind as on many ranks."""
    torch.set_num_threads(config.threads())
    world, rank, local_rank = _place()
    _check_world(config.parallel, world)
    device = _device(local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if torch_dist.is_initialized():
        return Dist(rank, world, local_rank, device, torch_dist.get_backend())
    if world == 1 and config.parallel.strategy not in ("ddp", "fsdp2"):
        return Dist(0, 1, local_rank, device, "none")
    _join(backend, world, device)
    return Dist(rank, world, local_rank, device, backend)


def launched(config: TrainConfig) -> TrainConfig:
    """`config` for the world this process was started in. Under torchrun (WORLD_SIZE,
    LOCAL_WORLD_SIZE) a config that names no ranks takes the launcher's, several ranks
    without a strategy train data-parallel (ddp), and the node's cores are shared out among
    its ranks, as Accelerate and Lightning do: one script runs under --nproc-per-node 1 and 2
    unchanged. A config that names its ranks is held to them (see setup)."""
    world = _place()[0]
    if world == 1 or config.parallel.ranks != 1:
        return config
    changes: dict[str, Any] = {"ranks": world}
    if config.parallel.strategy == "single":
        changes["strategy"] = "ddp"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if config.parallel.threads_per_rank is None:
        changes["threads_per_rank"] = max(1, (os.cpu_count() or 1) // local)
    return config.replace(parallel=changes)


def teardown() -> None:
    """End the process group if `setup` made it (a group the caller made is theirs). The
    DDP models `wrap` made are unusable afterwards."""
    global _made_group
    if _made_group and torch_dist.is_initialized():
        _release_reducers()
        torch_dist.destroy_process_group()
    _made_group = False


_REDUCE_OPS = {"sum": "SUM", "mean": "SUM", "max": "MAX", "min": "MIN"}


def reduce(value: float | torch.Tensor, op: str, dist: Dist) -> Any:
    """`value` (a number, or a tensor of one shape on every rank) combined over the ranks —
    sum, mean, max or min — on every rank; a number comes back a float, a tensor a tensor
    on its own device. Every rank must call it."""
    if op not in _REDUCE_OPS:
        raise KilnError(f"reduce op '{op}': use one of {', '.join(_REDUCE_OPS)}.")
    number = not isinstance(value, torch.Tensor)
    tensor = torch.as_tensor(value, dtype=torch.float64 if number else None)
    home = tensor.device
    if dist.world > 1:  # NCCL reduces on this rank's GPU, gloo on the CPU
        tensor = tensor.detach().to(dist.device, copy=True)
        torch_dist.all_reduce(tensor, getattr(torch_dist.ReduceOp, _REDUCE_OPS[op]))
    if op == "mean":
        tensor = tensor / dist.world
    return float(tensor) if number else tensor.to(home)


def gather(value: Any, dist: Dist) -> list[Any]:
    """Every rank's `value`, in rank order, on every rank: a tensor of one shape on every
    rank is gathered as tensors (on its own device), anything else that pickles as objects.
    Every rank must call it."""
    if dist.world == 1:
        return [value]
    if isinstance(value, torch.Tensor):
        tensor = value.detach().to(dist.device).contiguous()
        parts = [torch.empty_like(tensor) for _ in range(dist.world)]
        torch_dist.all_gather(parts, tensor)
        return [part.to(value.device) for part in parts]
    found: list[Any] = [None] * dist.world
    torch_dist.all_gather_object(found, value)
    return found


def _release_reducers() -> None:
    """Free each DDP model's C++ reducer (and the logger that shares it) now, while the
    process group is still held elsewhere. Otherwise the reducer is the group's last owner,
    and freeing it later runs the gloo group's destructor with the GIL held: the destructor
    joins gloo's worker threads, one of which may be waiting for the GIL to free a finished
    all-reduce, and the rank hangs (seen here in 2 of 6 runs; pytorch#56297). The group's
    own Python handle releases the GIL when it goes."""
    for model in list(_ddp_models):
        for name in ("logger", "reducer"):
            if hasattr(model, name):
                delattr(model, name)


def _place() -> tuple[int, int, int]:
    if torch_dist.is_initialized():
        rank = torch_dist.get_rank()
        return torch_dist.get_world_size(), rank, int(os.environ.get("LOCAL_RANK", rank))
    env = os.environ
    return int(env.get("WORLD_SIZE", 1)), int(env.get("RANK", 0)), int(env.get("LOCAL_RANK", 0))


def _check_world(parallel: Parallel, world: int) -> None:
    if parallel.ranks != world:
        n = parallel.ranks
        raise KilnError(
            f"parallel.ranks is {n} but this process is one of {world} rank(s): start {n} "
            f"ranks with `kiln train --nproc {n}` or `torchrun --nproc-per-node {n}`, or set "
            f"parallel.ranks to {world}."
        )


def _device(local_rank: int) -> torch.device:
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def _join(backend: str, world: int, device: torch.device) -> None:
    global _made_group
    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    # Without torchrun's rendezvous (a one-rank ddp/fsdp2 run) an in-memory store will do.
    store = None if "MASTER_ADDR" in os.environ else torch_dist.HashStore()
    extra: dict[str, Any] = {"store": store, "rank": 0, "world_size": 1} if store else {}
    if device.type == "cuda":  # NCCL binds this rank's GPU now, not at its first collective
        extra["device_id"] = device
    try:
        torch_dist.init_process_group(backend, timeout=timeout, **extra)
    except (RuntimeError, ValueError) as exc:  # DistStoreError/DistNetworkError included
        where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        first = " ".join(str(exc).split())[:200]
        raise KilnError(
            f"could not join the {world}-rank process group at {where} within "
            f"{GROUP_TIMEOUT_S:g} s ({first}); start every rank with the same MASTER_ADDR "
            "and MASTER_PORT (torchrun does)."
        ) from None
    _made_group = True


def wrap(model: nn.Module, config: TrainConfig, dist: Dist) -> nn.Module:
    """The model wrapped for `config.parallel.strategy`: single → as is, ddp →
    DistributedDataParallel, fsdp2 → `fully_shard` on each block, then the root."""
    strategy = config.parallel.strategy
    if strategy == "single":
        return model
    if strategy == "pipeline":
        raise KilnError(
            "parallel.strategy pipeline splits the model into stages: build it with "
            "kiln.train.parallel.pipeline(...), not wrap(...)."
        )
    if not torch_dist.is_initialized():
        raise KilnError(f"parallel.strategy {strategy} needs ranks: call setup(config) first.")
    if strategy == "ddp":
        return _ddp(model.to(dist.device), config.parallel, dist)
    return _fsdp2(model, config.parallel, dist)


def _ddp(model: nn.Module, parallel: Parallel, dist: Dist) -> DistributedDataParallel:
    wrapped = DistributedDataParallel(
        model,
        device_ids=[dist.device.index] if dist.device.type == "cuda" else None,
        bucket_cap_mb=parallel.bucket_mb,
        gradient_as_bucket_view=parallel.gradient_as_bucket_view,
        static_graph=parallel.static_graph,
    )
    if parallel.comm_hook == "bf16" and dist.backend != "nccl":
        # DDP accepts bf16 compression only over NCCL (CUDA 11+, NCCL 2.10+).
        raise KilnError(
            "parallel.comm_hook bf16 needs NCCL (CUDA GPUs); on CPUs (gloo) use fp16 or none."
        )
    if parallel.comm_hook != "none":
        # State None: the hook all-reduces over the default (whole-world) group.
        wrapped.register_comm_hook(None, _COMM_HOOKS[parallel.comm_hook])
    _ddp_models.add(wrapped)
    return wrapped


def _fsdp2(model: nn.Module, parallel: Parallel, dist: Dist) -> nn.Module:
    mesh = init_device_mesh(dist.device.type, (dist.world,))
    policy = MixedPrecisionPolicy(
        param_dtype=_dtype(parallel.param_dtype), reduce_dtype=_dtype(parallel.reduce_dtype)
    )
    options: dict[str, Any] = {
        "mesh": mesh,
        "reshard_after_forward": parallel.reshard_after_forward,
        "mp_policy": policy,
    }
    # Each block its own unit, so one block's parameters are gathered at a time; the root
    # takes what is left (embeddings, head).
    for _, block in find_blocks(model):
        fully_shard(block, **options)
    fully_shard(model, **options)
    return model


def _dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else _DTYPES[name]


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """Gradient synchronisation off inside (accumulation micro-steps): gradients add up
    locally and are reduced on the first backward after the block."""
    if isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
    elif isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


class PipelineRunner:
    """This rank's stage(s) of a pipeline and the schedule that runs them.

    `module` holds this rank's parameters (what the optimizer takes): the stage module (its
    parameters keep the model's names), or for an interleaved schedule an nn.ModuleDict of
    the rank's two stages ("stage0", "stage2": names prefixed by the stage)."""

    def __init__(
        self,
        stages: list[pipelining.PipelineStage],
        parallel: Parallel,
        loss_fn: Callable[..., torch.Tensor],
    ) -> None:
        self.stages = stages
        self.module: nn.Module = stages[0].submod
        if len(stages) > 1:  # named by stage, so each name is the same on every run
            self.module = nn.ModuleDict({f"stage{s.stage_index}": s.submod for s in stages})
        self.microbatches = parallel.microbatches
        self.is_first = any(stage.is_first for stage in stages)
        self.is_last = any(stage.is_last for stage in stages)
        self._loss_fn = loss_fn
        self._scale = 1.0
        self.schedule = _schedule(stages, parallel, self._loss)

    def step(
        self,
        inputs: torch.Tensor | tuple[torch.Tensor, ...],
        targets: torch.Tensor,
        loss_scale: float = 1.0,
    ) -> torch.Tensor | None:
        """Forward and backward of one micro_batch, cut into the schedule's microbatches.

        Gradients add to the parameters' .grad (as loss.backward() would): they are those of
        the mean loss times `loss_scale` (give 1/accumulation, times the fp16 loss scale).
        Returns the mean loss (unscaled, detached) on the last stage's rank, else None."""
        args = inputs if isinstance(inputs, tuple) else (inputs,)
        losses: list[torch.Tensor] = []
        self._scale = loss_scale
        self.schedule.step(
            *(args if self.is_first else ()),
            target=targets if self.is_last else None,
            losses=losses,
            return_outputs=False,
        )
        if not self.is_last:
            return None
        return torch.stack([loss.detach() for loss in losses]).sum() / loss_scale

    def evaluate(self, dataset: Any, loss_fn: Callable[..., torch.Tensor],
                 micro_batch: int) -> dict[str, float] | None:  # fmt: skip
        """The mean loss over `dataset` (whole micro-batches), forward only through the
        schedule; every rank takes part, the last stage's rank has the figure (None elsewhere,
        and where the dataset holds no whole micro-batch)."""
        from torch.utils.data import DataLoader

        total, count = 0.0, 0
        self._scale = 1.0
        for inputs, targets in DataLoader(dataset, batch_size=micro_batch, drop_last=True):
            losses: list[torch.Tensor] = []
            args = inputs if isinstance(inputs, tuple) else (inputs,)
            self.schedule.eval(*(args if self.is_first else ()),
                               target=targets if self.is_last else None, losses=losses)  # fmt: skip
            if self.is_last:
                total += float(torch.stack([loss.detach() for loss in losses]).sum())
                count += 1
        return {"loss": total / count} if self.is_last and count else None

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # Scaled here rather than by the schedule's scale_grads, which divides every .grad
        # after the step and so would also divide gradients accumulated by earlier steps.
        return self._loss_fn(output, target) * (self._scale / self.microbatches)


def _schedule(
    stages: list[pipelining.PipelineStage], parallel: Parallel, loss: Callable[..., Any]
) -> Any:
    # The single-stage schedules take one stage, the interleaved one the list.
    held: Any = stages if len(stages) > 1 else stages[0]
    kind = _SCHEDULES[parallel.schedule]
    try:
        return kind(held, parallel.microbatches, loss_fn=loss, scale_grads=False)
    except ValueError as exc:
        first = " ".join(str(exc).split()).rstrip(".")
        raise KilnError(
            f"parallel.schedule {parallel.schedule} with {parallel.microbatches} microbatches "
            f"on {parallel.ranks} ranks: {first}; change parallel.microbatches."
        ) from None


def pipeline(
    model: nn.Module,
    config: TrainConfig,
    dist: Dist,
    loss_fn: Callable[..., torch.Tensor],
    example_inputs: torch.Tensor | tuple[torch.Tensor, ...],
) -> PipelineRunner:
    """Split `model` into stages at its block boundaries (an equal count of blocks each),
    build this rank's stage(s) and the schedule `config.parallel.schedule` over
    `config.parallel.microbatches` microbatches.

    `example_inputs` are the model's positional inputs (a tensor or a tuple) for one
    micro_batch; the split traces the model (torch.export) on their first microbatch, so its
    forward must export.
    interleaved1f1b gives each rank two stages (rank r: stages r and r + ranks)."""
    parallel = config.parallel
    if not torch_dist.is_initialized() or dist.world != parallel.ranks:
        raise KilnError("parallel.strategy pipeline needs its ranks: call setup(config) first.")
    _thread_lock_for_progress_bars()
    per_rank = _STAGES_PER_RANK[parallel.schedule]
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    example = _first_microbatch(example_inputs, parallel, _device_of(model))
    pipe = _split(model, parallel.ranks * per_rank, example)
    indices = [dist.rank + k * parallel.ranks for k in range(per_rank)]
    stages = [pipe.build_stage(index, dist.device) for index in indices]
    return PipelineRunner(stages, parallel, loss_fn)


def _thread_lock_for_progress_bars() -> None:
    """A stage runs through torch.fx's Interpreter, which opens a (disabled) tqdm bar, and
    tqdm's first bar makes a multiprocessing lock: a named semaphore that a rank ended by a
    signal (Ctrl-C) leaves behind, and Python's resource tracker warns about at exit. The
    rank's bars are its own threads': a thread lock serves them."""
    from torch.hub import tqdm  # tqdm's, where installed

    if hasattr(tqdm, "set_lock"):
        tqdm.set_lock(threading.RLock())


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters(), torch.empty(0)).device


def _first_microbatch(
    example_inputs: tuple[torch.Tensor, ...], parallel: Parallel, device: torch.device
) -> tuple[torch.Tensor, ...]:
    parts = parallel.microbatches
    first = []
    for tensor in example_inputs:
        if tensor.shape[0] % parts:
            raise KilnError(
                f"pipeline example input of batch {tensor.shape[0]} does not split into "
                f"parallel.microbatches {parts}: give one micro_batch (a multiple of {parts})."
            )
        first.append(tensor[: tensor.shape[0] // parts].to(device))  # traced with the model
    return tuple(first)


def _split(model: nn.Module, n_stages: int, example: tuple[torch.Tensor, ...]) -> Any:
    blocks = find_blocks(model)
    if len(blocks) < n_stages:
        raise KilnError(
            f"pipeline of {n_stages} stages: the model has {len(blocks)} repeated blocks (an "
            "nn.ModuleList/nn.Sequential of like modules) to cut between; use fewer ranks "
            "or another strategy."
        )
    cuts = {blocks[i * len(blocks) // n_stages][0] for i in range(1, n_stages)}
    spec = {name: pipelining.SplitPoint.BEGINNING for name in cuts}
    with warnings.catch_warnings():
        # torch.export's pytree deprecations, raised inside PyTorch, are not the user's.
        warnings.simplefilter("ignore", FutureWarning)
        try:
            return pipelining.pipeline(model, mb_args=example, split_spec=spec)
        except Exception as exc:  # torch.export fails in many ways on an untraceable forward
            first = " ".join(str(exc).split())[:200]
            raise KilnError(
                f"cannot split the model into {n_stages} pipeline stages: torch.export could "
                f"not trace its forward ({type(exc).__name__}: {first}); use ddp or fsdp2."
            ) from None
