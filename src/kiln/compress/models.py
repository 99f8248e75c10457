"""The two models the compression methods are shown on: a digits CNN and a small ViT-style
transformer encoder that reads the digit as a sequence of 8×8 patches.

Both are plain `nn.Module`s a structured pruner can read: the CNN is conv → batch-norm → ReLU
blocks in stages, the transformer's attention keeps its head count in `Attention.num_heads` (the
head width follows from the projections), so heads and FFN neurons can be cut physically.
"""

from __future__ import annotations

import torch
from torch import nn


def conv_block(inputs: int, outputs: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(inputs, outputs, 3, padding=1, bias=False),
        nn.BatchNorm2d(outputs),
        nn.ReLU(),
    )


class DigitsCNN(nn.Module):
    """Stages of `convs` 3×3 conv blocks at widths `widths`, each stage halving the image
    (32 → 16 → 8 → 4), then global average pooling and a linear classifier."""

    input_shape = (1, 32, 32)  # what it is built for (it would run on other sizes too)

    def __init__(
        self, widths: tuple[int, ...] = (32, 64, 128), convs: int = 2, classes: int = 10
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 1
        for width in widths:
            for _ in range(convs):
                layers.append(conv_block(channels, width))
                channels = width
            layers.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


class Attention(nn.Module):
    """Multi-head self-attention with separate q/k/v projections (one head = a slice of
    `head_dim` output features of each). The names (q_proj … out_proj, num_heads) are the ones
    kiln.compress.prune looks for when it removes heads."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.num_heads = heads
        self.head_dim = dim // heads
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        shape = (b, n, self.num_heads, self.head_dim)
        q = self.q_proj(x).reshape(shape).transpose(1, 2)
        k = self.k_proj(x).reshape(shape).transpose(1, 2)
        v = self.v_proj(x).reshape(shape).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.head_dim**-0.5
        out = torch.matmul(scores.softmax(dim=-1), v)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, self.num_heads * self.head_dim))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """A pre-norm transformer encoder layer."""

    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.ffn = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.ffn(self.norm2(x))


class PatchTransformer(nn.Module):
    """ViT-style encoder: 8×8 patches of the 32×32 digit (16 tokens), `depth` layers of
    `heads`-head attention and a `4·dim` FFN, mean-pooled into a linear classifier."""

    def __init__(
        self,
        dim: int = 128,
        depth: int = 4,
        heads: int = 4,
        patch: int = 8,
        side: int = 32,
        classes: int = 10,
    ) -> None:
        super().__init__()
        self.input_shape = (1, side, side)
        self.embed = nn.Conv2d(1, dim, patch, stride=patch)
        self.position = nn.Parameter(torch.zeros(1, (side // patch) ** 2, dim))
        nn.init.trunc_normal_(self.position, std=0.02)
        self.blocks = nn.Sequential(*(Block(dim, heads, 4 * dim) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.classifier = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x).flatten(2).transpose(1, 2) + self.position
        return self.classifier(self.norm(self.blocks(tokens)).mean(dim=1))


def digits_cnn() -> DigitsCNN:
    """The digits CNN: widths 32–64–128, two convs per stage (≈ 77 MFLOP per image)."""
    return DigitsCNN()


def digits_transformer() -> PatchTransformer:
    """The patch transformer: 4 layers, 4 heads, dim 128, 16 tokens of 8×8 pixels."""
    return PatchTransformer()
