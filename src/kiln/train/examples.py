"""The real training tasks `kiln train` and benchmarks/train.py run, all offline (no model hub).

Kiln reads a task as `module:function` names called with no arguments, so each model and dataset
comes as a zero-argument factory next to the parameterised builder it wraps:

- a GPT-style byte-level language model (`ByteLM`; `byte_lm`, `byte_lm_small`, `byte_lm_tiny`)
  trained with `lm_loss` on the Python standard library's own source (`stdlib_text`,
  `stdlib_text_small`, `stdlib_text_tiny`), text every machine with Python has;
- the digits CNN `kiln compress` uses (`digits_cnn`, `digits_cnn_wide`) on its offline digits
  dataset (`digits`).

Datasets are `{"train": Dataset, "val": Dataset}` of (input, target) pairs.

    kiln train kiln.train.examples:byte_lm_small kiln.train.examples:stdlib_text_small \
        --loss kiln.train.examples:lm_loss
"""

from __future__ import annotations

import math
import os
import sysconfig
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, TensorDataset

if TYPE_CHECKING:
    from collections.abc import Iterable

    from kiln.compress.models import DigitsCNN

VOCAB = 256  # one token per byte value
MB = 1 << 20
VAL_EVERY = 10  # every 10th file (by sorted path) is validation
SKIPPED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__"})


# --- the byte-level language model ------------------------------------------------------------


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention. Separate q/k/v projections and `num_heads` use the
    names kiln.compress.prune looks for, so heads of a trained model can be pruned."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        self.num_heads = heads
        self.head_dim = width // heads
        self.q_proj = nn.Linear(width, width)
        self.k_proj = nn.Linear(width, width)
        self.v_proj = nn.Linear(width, width)
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        shape = (b, t, self.num_heads, self.head_dim)
        projections = (self.q_proj, self.k_proj, self.v_proj)
        q, k, v = (p(x).view(shape).transpose(1, 2) for p in projections)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class Block(nn.Module):
    """A pre-LN transformer block: x + attn(LN(x)), then x + MLP(LN(x)) with a 4× GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ByteLM(nn.Module):
    """A GPT-style language model over bytes: token + learned position embeddings, `n_layers`
    `Block`s in `self.layers` (the repeated blocks kiln.train checkpoints and shards), a final
    LayerNorm and a linear head. forward: LongTensor [B, T ≤ seq] → logits [B, T, 256]."""

    def __init__(
        self, n_layers: int = 6, width: int = 384, heads: int = 6, seq: int = 256,
        tie: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.seq = seq
        self.embed = nn.Embedding(VOCAB, width)
        self.position = nn.Embedding(seq, width)
        self.layers = nn.ModuleList(Block(width, heads) for _ in range(n_layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB, bias=False)
        self._init_weights(n_layers)
        # Untied by default: a tied weight cannot live in two pipeline stages.
        if tie:
            self.head.weight = self.embed.weight

    def _init_weights(self, n_layers: int) -> None:
        # GPT-2's init: N(0, 0.02), residual-branch outputs scaled down by depth so the
        # residual stream's variance does not grow with the number of layers.
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for block in self.layers:
            for proj in (block.attn.out_proj, block.mlp[2]):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        if t > self.seq:
            raise ValueError(f"sequence of {t} bytes; this model reads at most {self.seq}")
        h = self.embed(x) + self.position(torch.arange(t, device=x.device))
        for block in self.layers:
            h = block(h)
        return self.head(self.norm(h))


def byte_lm(layers: int = 6, width: int = 384, heads: int = 6, seq: int = 256) -> ByteLM:
    """A ByteLM of `layers` blocks of `width` features and `heads` heads, reading `seq` bytes."""
    return ByteLM(layers, width, heads, seq)


def byte_lm_small() -> ByteLM:
    """The benchmark's language model: 4 layers, width 256, 4 heads, 256 bytes of context."""
    return byte_lm(layers=4, width=256, heads=4, seq=256)


def byte_lm_tiny() -> ByteLM:
    """A test-sized language model: 2 layers, width 64, 2 heads, 64 bytes of context."""
    return byte_lm(layers=2, width=64, heads=2, seq=64)


def lm_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """The LM's optimizer in the benchmark: AdamW at lr 3e-4 (weight decay 0.01). At batch 8
    the default lr 1e-3 spikes on some batches, so two runs of the same fp32 step end up to
    6 % apart after 160 steps; with this lr and gradients clipped at norm 1 (as PyTorch's own
    word-language-model example clips) a 1 % loss comparison means something."""
    return torch.optim.AdamW(params, lr=3e-4, weight_decay=0.01)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-byte cross-entropy: logits [B, T, V] against targets [B, T], averaged over B·T."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# --- its data: the standard library's source ---------------------------------------------------


class ByteChunks(Dataset):
    """Non-overlapping windows of seq + 1 bytes of `data`, each giving (input, target): the
    window's first `seq` bytes and the `seq` bytes one later, both int64. `files` names the
    source files the bytes came from."""

    def __init__(self, data: bytes, seq: int, files: tuple[str, ...] = ()) -> None:
        # Kept as uint8 (a quarter of int64's memory); widened one window at a time.
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self.seq = seq
        self.files = files

    def __len__(self) -> int:
        return len(self.data) // (self.seq + 1)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(index)
        start = index * (self.seq + 1)
        window = self.data[start : start + self.seq + 1].long()
        return window[:-1], window[1:]


def stdlib_files(root: str | None = None) -> list[str]:
    """The standard library's *.py files as paths relative to `root` (default: this Python's
    stdlib), sorted, without site-packages, test directories or caches."""
    root = root or sysconfig.get_paths()["stdlib"]
    found = []
    for folder, dirs, files in os.walk(root):  # does not follow symlinks: no loops
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS]
        rel = Path(folder).relative_to(root)
        found += [(rel / f).as_posix() for f in files if f.endswith(".py")]
    return sorted(found)


def _read_until(root: str, files: list[str], cap: int) -> tuple[bytes, tuple[str, ...]]:
    """The concatenated bytes of `files` in order, reading no file past the one that reaches
    `cap` bytes and cutting the result to `cap`; also the names of the files read."""
    parts, used, total = [], [], 0
    for name in files:
        if total >= cap:
            break
        parts.append(Path(root, name).read_bytes())
        used.append(name)
        total += len(parts[-1])
    return b"".join(parts)[:cap], tuple(used)


def stdlib_text(
    seq: int = 256, max_bytes: int | None = None, val_bytes: int | None = None
) -> dict[str, ByteChunks]:
    """{"train", "val"} ByteChunks of the stdlib's source, split by file (every 10th sorted file
    is validation, so no file is in both). At most `max_bytes` of train (default 8 MB) and
    `val_bytes` of validation (default an eighth of max_bytes) are read."""
    cap = 8 * MB if max_bytes is None else max_bytes
    val_cap = cap // 8 if val_bytes is None else val_bytes
    root = sysconfig.get_paths()["stdlib"]
    files = stdlib_files(root)
    train = [f for i, f in enumerate(files) if i % VAL_EVERY != VAL_EVERY - 1]
    val = [f for i, f in enumerate(files) if i % VAL_EVERY == VAL_EVERY - 1]
    return {
        "train": _chunks(root, train, cap, seq),
        "val": _chunks(root, val, val_cap, seq),
    }


def _chunks(root: str, files: list[str], cap: int, seq: int) -> ByteChunks:
    """ByteChunks of the first `cap` bytes of `files`."""
    data, used = _read_until(root, files, cap)
    return ByteChunks(data, seq, used)


def stdlib_text_small() -> dict[str, ByteChunks]:
    """The benchmark's text: 256-byte windows, 8 MB of train and 1 MB of validation."""
    return stdlib_text(seq=256)


def stdlib_text_tiny() -> dict[str, ByteChunks]:
    """Test-sized text: 64-byte windows, 200 KB of train and 50 KB of validation."""
    return stdlib_text(seq=64, max_bytes=200_000, val_bytes=50_000)


# --- the digits CNN task of `kiln compress` -----------------------------------------------------


# kiln.compress loads only when a digits task is asked for: it costs the LM task ~0.7 s.


def digits_cnn() -> DigitsCNN:
    """kiln.compress's digits CNN: widths 32–64–128, two convs per stage (≈ 77 MFLOP/image)."""
    from kiln.compress.models import digits_cnn as build

    return build()


def digits_cnn_wide() -> DigitsCNN:
    """The digits CNN at twice the widths (64–128–256): ≈ 4× the FLOPs (≈ 0.3 GFLOP per
    image), so convolution compute, not per-step overhead, dominates a training step."""
    from kiln.compress.models import DigitsCNN

    return DigitsCNN(widths=(64, 128, 256))


def digits() -> dict[str, TensorDataset]:
    """kiln.compress's offline digits (32×32): {"train": its train split, "val": its validation
    split} as TensorDatasets of (x float32 [1, 32, 32] in [0, 1], y int64). Its test split is
    left out, as `kiln compress` keeps it for the reported accuracy."""
    from kiln.compress.data import digits as load

    data = load()
    return {
        "train": TensorDataset(data.train.x, data.train.y),
        "val": TensorDataset(data.val.x, data.val.y),
    }
