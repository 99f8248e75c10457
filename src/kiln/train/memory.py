"""Activation checkpointing, and the peak resident memory a training process reaches.

Checkpointing wraps a model's *blocks* — the children of its largest nn.ModuleList or
nn.Sequential of like modules (a transformer's layers, a CNN's conv blocks between its
parameter-free pooling) — in PyTorch's
non-reentrant `checkpoint_wrapper`, as torchtitan does: a wrapped block keeps only its input
for backward and recomputes the rest. Which blocks is `Checkpointing.policy`: all (`full`),
every k-th (`every`), those of named module types (`selective`), or as few as keep a measured
peak under a budget (`budget`, decided by `blocks_for_budget` from two probes).

Checkpointing saves memory only if the freed activations leave the process: glibc's malloc
raises its mmap threshold to the largest block ever freed (up to 32 MiB), after which a step's
activations come from heap arenas that it keeps — the resident peak of a checkpointed step then
falls by a fraction of what the live tensors do (byte_lm_small, batch 8 × 256: 14 % instead of
44 %). `give_back_large_frees` fixes the threshold so that large blocks are mapped and unmapped,
and is set where checkpointing is on: the user traded time for memory.

Peak memory is the kernel's high-water mark of this process's resident set (VmHWM), reset by
writing 5 to /proc/self/clear_refs, so one process can measure several phases in turn; on
CPUs PyTorch's allocator keeps no peak of its own.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from kiln.backends.release import return_frees_above
from kiln.errors import KilnError
from kiln.runtime.footprint import peak_rss_mib, reset_peak, rss_mib
from kiln.train.config import Checkpointing

Block = tuple[str, nn.Module]


def find_blocks(model: nn.Module) -> list[Block]:
    """The qualified names and modules of the model's repeated blocks: the children of its
    largest nn.ModuleList / nn.Sequential whose children that hold parameters (≥ 2) are all of
    one type; [] when the model has none. Children without parameters (a CNN's pooling
    between stages, an activation) are not blocks and are not recomputed."""
    best: list[Block] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList | nn.Sequential):
            continue
        children = [(n, c) for n, c in module.named_children() if _has_parameters(c)]
        kinds = {type(child) for _, child in children}
        if len(children) >= 2 and len(kinds) == 1 and len(children) > len(best):
            prefix = f"{name}." if name else ""
            best = [(prefix + child_name, child) for child_name, child in children]
    return best


def _has_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def chosen_blocks(model: nn.Module, policy: Checkpointing) -> list[Block]:
    """The blocks `policy` checkpoints (before any budget probe: `budget` → all of them)."""
    if policy.policy == "none":
        return []
    if policy.policy == "selective":
        wanted = set(policy.modules)
        found = [(n, m) for n, m in model.named_modules() if type(m).__name__ in wanted and n]
        if not found:
            kinds = sorted({type(m).__name__ for _, m in model.named_modules()})
            raise KilnError(
                f"checkpointing.modules {sorted(wanted)}: no module of those types in the "
                f"model; its module types are {', '.join(kinds)}."
            )
        return _outermost(found)
    blocks = find_blocks(model)
    if not blocks:
        kinds = sorted({type(m).__name__ for n, m in model.named_children()})
        example = json.dumps({"checkpointing": {"policy": "selective", "modules": kinds[:1]}})
        raise KilnError(
            f"checkpointing.policy {policy.policy}: the model has no repeated blocks (an "
            "nn.ModuleList or nn.Sequential of like modules) to checkpoint; name the module "
            f"types to recompute (its children: {', '.join(kinds)}) in the TrainConfig, "
            f"e.g. kiln train … --config '{example}'."
        )
    if policy.policy == "every":
        return blocks[policy.every - 1 :: policy.every]
    return blocks


def apply_checkpointing(model: nn.Module, blocks: list[Block], compiled: bool = False) -> int:
    """Wrap each block in place in a non-reentrant checkpoint wrapper; how many were wrapped.
    The wrapper keeps the block's state-dict keys (it strips its own prefix). A block's
    batch-norm running statistics are updated once per step, as without checkpointing: the
    recomputation puts them back as it found them — except where the model is then
    `compiled`: torch.compile takes no recompute context but its own dispatch modes, and the
    recomputation moves the statistics a second time."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )

    for name, block in blocks:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        options: dict[str, Any] = {}
        if not compiled and _norms(block):
            options["context_fn"] = functools.partial(_contexts, block)
        wrapped = checkpoint_wrapper(block, checkpoint_impl=CheckpointImpl.NO_REENTRANT, **options)
        if isinstance(parent, nn.ModuleList | nn.Sequential) and child.isdigit():
            parent[int(child)] = wrapped
        else:
            setattr(parent, child, wrapped)
    return len(blocks)


def _norms(block: nn.Module) -> list[nn.Module]:
    return [m for m in block.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def _contexts(block: nn.Module) -> tuple[AbstractContextManager, AbstractContextManager]:
    """torch.utils.checkpoint's (forward, recompute) contexts for `block`."""
    return contextlib.nullcontext(), _statistics_kept(block)


@contextlib.contextmanager
def _statistics_kept(block: nn.Module) -> Iterator[None]:
    """Run the recomputation with the block's batch-norm buffers restored afterwards: a
    training-mode BatchNorm recomputed would otherwise move its running mean and variance a
    second time per step (and count the batch twice)."""
    norms = _norms(block)
    saved = [{k: b.detach().clone() for k, b in m.named_buffers(recurse=False)} for m in norms]
    try:
        yield
    finally:
        with torch.no_grad():
            for norm, buffers in zip(norms, saved, strict=True):
                for key, value in buffers.items():
                    getattr(norm, key).copy_(value)


def blocks_for_budget(
    blocks: list[Block], peak_without: float, peak_with_all: float, budget_mib: float
) -> list[Block]:
    """The fewest blocks (spread evenly) whose checkpointing brings the measured peak under
    `budget_mib`, assuming each block holds an equal share of the activations the two probes
    differ by. KilnError when even checkpointing every block does not fit."""
    if peak_without <= budget_mib:
        return []
    if peak_with_all > budget_mib:
        raise KilnError(
            f"memory budget {budget_mib:.0f} MiB: even with every block checkpointed the "
            f"step peaks at {peak_with_all:.0f} MiB (without: {peak_without:.0f} MiB); lower "
            "micro_batch (and raise accumulation) or raise the budget."
        )
    share = (peak_without - peak_with_all) / len(blocks)
    count = min(len(blocks), math.ceil((peak_without - budget_mib) / max(share, 1e-9)))
    stride = len(blocks) / count
    return [blocks[int(i * stride)] for i in range(count)]


MMAP_THRESHOLD_BYTES = 64 * 1024  # blocks above this go back to the OS when freed


def give_back_large_frees() -> bool:
    """Make glibc return every freed block over 64 KiB to the OS; False off glibc, where
    nothing is changed."""
    return return_frees_above(MMAP_THRESHOLD_BYTES)


def measure_peak(run: Callable[[], object]) -> float:
    """The resident peak (MiB) reached while `run` runs, above what was resident before."""
    before = rss_mib()
    reset_peak()
    run()
    return max(0.0, peak_rss_mib() - before)


def _outermost(found: list[Block]) -> list[Block]:
    """Drop modules nested inside another found one: it is recomputed with its parent."""
    names = [n for n, _ in found]
    return [(n, m) for n, m in found if not any(n.startswith(p + ".") for p in names if p != n)]
