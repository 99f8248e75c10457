"""The DataLoader a TrainConfig describes: micro-batch, workers, prefetch, pinning, persistent
workers, and under data-parallel ranks a DistributedSampler giving each rank its share.

A pipeline's ranks hold stages of one model, so every rank reads the same batches (the first
stage uses the inputs, the last the targets): no sampler splits them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from kiln.errors import KilnError, a_type
from kiln.train.config import TrainConfig
from kiln.train.parallel import Dist


class EpochLoader:
    """A DataLoader that starts a new epoch (a new shuffle, also across ranks) each time it is
    iterated: DistributedSampler otherwise repeats epoch 0's order unless set_epoch is called.

    `seek(samples)` positions it where a run that had already taken `samples` samples (on
    this rank) would be, without reading them: whole epochs are replayed through the sampler
    alone, which draws from the seeded generator exactly as the real epochs did, and the
    samples of the current epoch are skipped as indices."""

    def __init__(self, loader: DataLoader, sampler: Skipping) -> None:
        self.loader, self.sampler, self.epoch = loader, sampler, 0
        self._skip = 0  # indices the next epoch starts past (set by seek)

    def __iter__(self) -> Iterator[Any]:
        inner = self.sampler.inner
        if isinstance(inner, DistributedSampler):
            inner.set_epoch(self.epoch)
        self.sampler.skip, self._skip = self._skip, 0
        self.epoch += 1
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)

    def seek(self, samples: int) -> None:
        """Go on after `samples` samples of this rank (counted from the first epoch)."""
        per_epoch = len(self.loader) * (self.loader.batch_size or 1)
        epochs, rest = divmod(samples, per_epoch) if per_epoch else (0, 0)
        for _ in range(epochs):  # no batch comes out: the sampler skips the whole epoch
            self._skip = len(self.sampler)
            for _ in self:
                pass
        self._skip = rest


class Skipping(Sampler[int]):
    """A sampler that, once, starts past its first `skip` indices (drawing them all the same,
    so that a shuffle's generator advances as it did in the run being continued)."""

    def __init__(self, inner: Sampler[int]) -> None:
        self.inner, self.skip = inner, 0

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(iter(self.inner), self.skip, None)

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]


def make_loader(dataset: Any, config: TrainConfig, dist: Dist, **overrides: Any) -> EpochLoader:
    """See the module docstring; `overrides` go to the DataLoader (e.g. collate_fn)."""
    if not isinstance(dataset, Dataset) and not hasattr(dataset, "__getitem__"):
        raise KilnError(
            f"the dataset is {a_type(dataset)}; expected a map-style Dataset "
            "(__getitem__ and __len__) of (input, target) pairs."
        )
    settings = config.loader
    replicas = config.parallel.strategy in ("ddp", "fsdp2") and dist.world > 1
    generator = torch.Generator().manual_seed(config.seed)
    shuffle = overrides.pop("shuffle", settings.shuffle)
    sampler = overrides.pop("sampler", None) or _sampler(dataset, config, dist, replicas,
                                                          shuffle, generator)  # fmt: skip
    kwargs: dict[str, Any] = {
        "batch_size": config.micro_batch,
        "sampler": Skipping(sampler),
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
    return EpochLoader(DataLoader(dataset, **kwargs), kwargs["sampler"])


def _sampler(dataset: Any, config: TrainConfig, dist: Dist, replicas: bool, shuffle: bool,
             generator: torch.Generator) -> Sampler[int]:  # fmt: skip
    """The sampler DataLoader(shuffle=..., generator=...) would make, or the ranks' share."""
    if replicas:
        return DistributedSampler(dataset, num_replicas=dist.world, rank=dist.rank,
                                  shuffle=shuffle, seed=config.seed,
                                  drop_last=config.loader.drop_last)  # fmt: skip
    return RandomSampler(dataset, generator=generator) if shuffle else SequentialSampler(dataset)
