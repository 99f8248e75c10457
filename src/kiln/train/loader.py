"""The DataLoader a TrainConfig describes: micro-batch, workers, prefetch, pinning, persistent
workers, and under data-parallel ranks a DistributedSampler giving each rank its share.

A pipeline's ranks hold stages of one model, so every rank reads the same batches (the first
stage uses the inputs, the last the targets): no sampler splits them.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from kiln.errors import KilnError
from kiln.train.config import TrainConfig
from kiln.train.parallel import Dist


class EpochLoader:
    """A DataLoader that starts a new epoch (a new shuffle, also across ranks) each time it is
    iterated: DistributedSampler otherwise repeats epoch 0's order unless set_epoch is called."""

    def __init__(self, loader: DataLoader, sampler: DistributedSampler | None) -> None:
        self.loader, self.sampler, self.epoch = loader, sampler, 0

    def __iter__(self) -> Iterator[Any]:
        if self.sampler is not None:
            self.sampler.set_epoch(self.epoch)
        self.epoch += 1
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)


def make_loader(dataset: Any, config: TrainConfig, dist: Dist, **overrides: Any) -> EpochLoader:
    """See the module docstring; `overrides` go to the DataLoader (e.g. collate_fn)."""
    if not isinstance(dataset, Dataset) and not hasattr(dataset, "__getitem__"):
        raise KilnError(
            f"the dataset is a {type(dataset).__name__}; expected a map-style Dataset "
            "(__getitem__ and __len__) of (input, target) pairs."
        )
    settings = config.loader
    replicas = config.parallel.strategy in ("ddp", "fsdp2") and dist.world > 1
    sampler = (
        DistributedSampler(
            dataset,
            num_replicas=dist.world,
            rank=dist.rank,
            shuffle=settings.shuffle,
            seed=config.seed,
            drop_last=settings.drop_last,
        )  # fmt: skip
        if replicas
        else None
    )
    generator = torch.Generator().manual_seed(config.seed)
    kwargs: dict[str, Any] = {
        "batch_size": config.micro_batch,
        "shuffle": settings.shuffle if sampler is None else False,
        "sampler": sampler,
        "num_workers": settings.workers,
        "pin_memory": settings.pin_memory and torch.cuda.is_available(),
        "drop_last": settings.drop_last,
        "generator": generator,
    }
    if settings.workers > 0:
        kwargs["persistent_workers"] = settings.persistent_workers
        if settings.prefetch_factor is not None:
            kwargs["prefetch_factor"] = settings.prefetch_factor
    kwargs.update(overrides)
    return EpochLoader(DataLoader(dataset, **kwargs), sampler)
