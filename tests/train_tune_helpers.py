"""A task for the training tuner's tests whose peak memory follows the micro-batch: a few
residual blocks that widen 16 features to 4,096 with cheap elementwise ops, so activations
(not weights or compute) dominate, on a learnable synthetic dataset. Trial processes import
it by name (tests/ is on their path), as they would a user's own module."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

FEATURES, WIDTH, CLASSES, BLOCKS = 16, 4096, 8, 4
SAMPLES, VAL = 2048, 256


class Wide(nn.Module):
    """x + down(gelu(h) · sigmoid(h)), h = up(LN(x)): four [B, WIDTH] tensors kept for
    backward per block."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(FEATURES)
        self.up = nn.Linear(FEATURES, WIDTH)
        self.down = nn.Linear(WIDTH, FEATURES)
        nn.init.normal_(self.down.weight, std=0.002)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(self.norm(x))
        return x + self.down(nn.functional.gelu(h) * torch.sigmoid(h))


class WideNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(*(Wide() for _ in range(BLOCKS)))
        self.norm = nn.LayerNorm(FEATURES)
        self.head = nn.Linear(FEATURES, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.layers(x)))


def wide_net() -> WideNet:
    return WideNet()


def blobs() -> dict[str, TensorDataset]:
    """Points labelled by the largest of 8 fixed projections: learnable in a few steps."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES + VAL, FEATURES, generator=generator)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=generator)).argmax(1)
    return {"train": TensorDataset(x[:SAMPLES], y[:SAMPLES]),
            "val": TensorDataset(x[SAMPLES:], y[SAMPLES:])}  # fmt: skip


def adamw(params: object) -> torch.optim.Optimizer:
    """A learning rate at which the loss falls visibly within a handful of steps."""
    return torch.optim.AdamW(params, lr=3e-3)


def blobs_announced() -> dict[str, TensorDataset]:
    """blobs(), after telling a waiting test that a trial process is about to train: its
    session id (every process of the trial shares it) written to the FIFO named by
    KILN_TEST_FIFO, where a reader is waiting (else nothing is said)."""
    import os

    fifo = os.environ.get("KILN_TEST_FIFO")
    if fifo:
        try:
            pipe = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        except OSError:  # no reader: nobody waits
            return blobs()
        os.write(pipe, f"{os.getsid(0)}\n".encode())
        os.close(pipe)
    return blobs()
