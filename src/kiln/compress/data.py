"""Real labelled data, offline: scikit-learn's bundled handwritten digits (1,797 8×8 images).

Images are upscaled to 32×32 so a CNN's compute, not its overhead, dominates. The split is
fixed (seeded) so every method and every run is judged on the same held-out test images.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

SIDE = 32
SPLIT_SEED = 0
FRACTIONS = (0.6, 0.2)  # train, validation; the rest is the held-out test split


@dataclass(frozen=True)
class Split:
    """One part of a dataset: inputs (N, 1, 32, 32) float32 in [0, 1] and labels (N,) int64."""

    x: torch.Tensor
    y: torch.Tensor

    def __len__(self) -> int:
        return len(self.y)

    def take(self, count: int) -> Split:
        return Split(self.x[:count], self.y[:count])


@dataclass(frozen=True)
class Dataset:
    """Train, validation (fine-tuning decisions) and test (the reported accuracy) splits."""

    name: str
    train: Split
    val: Split
    test: Split
    classes: int

    def subset(self, train: int, val: int, test: int) -> Dataset:
        """A smaller dataset for quick runs (tests): the first images of each split."""
        return Dataset(
            self.name, self.train.take(train), self.val.take(val), self.test.take(test),
            self.classes,
        )  # fmt: skip


def digits() -> Dataset:
    """The digits, upscaled to 32×32, split 60/20/20 with a fixed seed."""
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = torch.from_numpy(bunch.images.astype(np.float32) / 16.0).unsqueeze(1)
    images = torch.nn.functional.interpolate(
        images, size=(SIDE, SIDE), mode="bilinear", align_corners=False
    ).clamp(0.0, 1.0)
    labels = torch.from_numpy(bunch.target.astype(np.int64))
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(SPLIT_SEED))
    n_train = int(FRACTIONS[0] * len(order))
    n_val = int(FRACTIONS[1] * len(order))
    parts = order[:n_train], order[n_train : n_train + n_val], order[n_train + n_val :]
    train, val, test = (Split(images[i].contiguous(), labels[i]) for i in parts)
    return Dataset("digits", train, val, test, classes=10)


def batches(split: Split, size: int, shuffle: bool = False, seed: int = 0):
    """(inputs, labels) mini-batches of `split`."""
    order = (
        torch.randperm(len(split), generator=torch.Generator().manual_seed(seed))
        if shuffle
        else torch.arange(len(split))
    )
    for start in range(0, len(split), size):
        index = order[start : start + size]
        yield split.x[index], split.y[index]
