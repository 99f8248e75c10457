"""Short training recipes: AdamW with a cosine schedule, light shift augmentation, and the
accuracy on a split. The loss is pluggable (distillation adds the teacher's soft targets)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from kiln.compress.data import Dataset, Split, batches

Loss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # logits, x, y
Tick = Callable[[int, int], None]  # epoch done, epochs
BATCH = 64
SHIFT = 2  # pixels of random translation (the digits are not centred alike)


@dataclass(frozen=True)
class Recipe:
    """How long and how fast to train."""

    epochs: int = 20
    lr: float = 2e-3
    weight_decay: float = 0.05
    batch: int = BATCH
    seed: int = 0

    def scaled(self, fraction: float, lr: float | None = None) -> Recipe:
        """A shorter recipe (fine-tuning): `fraction` of the epochs, at least one."""
        epochs = max(1, round(self.epochs * fraction))
        return Recipe(epochs, lr or self.lr, self.weight_decay, self.batch, self.seed)


def cross_entropy(logits: torch.Tensor, _x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, y)


def fit(
    model: nn.Module,
    data: Dataset,
    recipe: Recipe,
    loss: Loss = cross_entropy,
    tick: Tick | None = None,
    deadline: float | None = None,
) -> nn.Module:
    """Train `model` in place on `data.train`; stops early (keeping what it learnt) when the
    `deadline` (a time.monotonic() value) passes."""
    torch.manual_seed(recipe.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=recipe.weight_decay)
    steps = recipe.epochs * -(-len(data.train) // recipe.batch)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=recipe.lr, total_steps=max(steps, 1), pct_start=0.15
    )
    model.train()
    for epoch in range(recipe.epochs):
        for x, y in batches(data.train, recipe.batch, shuffle=True, seed=recipe.seed + epoch):
            optimizer.zero_grad()
            x = shifted(x, recipe.seed * 1000 + epoch)
            loss(model(x), x, y).backward()
            optimizer.step()
            schedule.step()
        if tick is not None:
            tick(epoch + 1, recipe.epochs)
        if deadline is not None and time.monotonic() > deadline:
            break
    model.eval()
    return model


def shifted(x: torch.Tensor, seed: int) -> torch.Tensor:
    """Each image moved by up to SHIFT pixels in each direction (zeros fill the border)."""
    generator = torch.Generator().manual_seed(seed)
    padded = nn.functional.pad(x, (SHIFT,) * 4)
    dy, dx = torch.randint(0, 2 * SHIFT + 1, (2, len(x)), generator=generator)
    height, width = x.shape[-2:]
    return torch.stack([
        padded[i, :, dy[i] : dy[i] + height, dx[i] : dx[i] + width] for i in range(len(x))
    ])  # fmt: skip


@torch.no_grad()
def accuracy(model: nn.Module | Callable[[torch.Tensor], torch.Tensor], split: Split) -> float:
    """Top-1 accuracy of `model` on `split`, in [0, 1]."""
    if isinstance(model, nn.Module):
        model.eval()
    right = 0
    for x, y in batches(split, 256):
        right += int((model(x).argmax(dim=-1) == y).sum())
    return right / max(len(split), 1)
