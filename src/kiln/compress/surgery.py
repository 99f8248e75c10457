"""Physical removal of units: a unit's rows and columns are cut out of the weight tensors.

A `Group` is one prunable layer: `units` equal units (channels, heads, neurons), the weight
slices that compute them (`producers`), the slices that read them (`consumers`), and the
per-unit vectors riding along (`followers`, e.g. a BatchNorm). Removing units keeps the
remaining weights bit-for-bit; only shapes shrink, so FLOPs and parameters really go down.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import chain

import torch
from torch import nn

Kind = str  # "channels" | "heads" | "neurons"


@dataclass(frozen=True)
class Slice:
    """`module.weight` along `dim` (0: outputs, 1: inputs) in `block` entries per unit."""

    module: nn.Module
    dim: int
    block: int = 1


@dataclass
class Group:
    """One prunable layer. `finish(keep)` updates attributes that count units (num_heads)."""

    name: str
    kind: Kind
    units: int
    owner: nn.Module
    producers: list[Slice]
    consumers: list[Slice]
    followers: list[nn.Module] = field(default_factory=list)
    finish: Callable[[torch.Tensor], None] | None = None

    def remove(self, keep: torch.Tensor) -> None:
        """Keep only the units `keep` (sorted indices); every other unit is cut out."""
        for piece in self.producers + self.consumers:
            _cut(piece, keep)
        for module in self.followers:
            _cut_norm(module, keep)
        if self.finish is not None:
            self.finish(keep)


def unit_view(weight: torch.Tensor, piece: Slice) -> torch.Tensor:
    """`weight` as (units, rest): unit u owns entries [u*block, (u+1)*block) along piece.dim."""
    moved = weight.movedim(piece.dim, 0)
    return moved.reshape(moved.shape[0] // piece.block, -1)


def _entries(keep: torch.Tensor, block: int) -> torch.Tensor:
    return (keep[:, None] * block + torch.arange(block)).reshape(-1)


def _cut(piece: Slice, keep: torch.Tensor) -> None:
    module, dim = piece.module, piece.dim
    index = _entries(keep, piece.block).to(module.weight.device)
    _replace(module, "weight", module.weight.index_select(dim, index))
    if dim == 0 and module.bias is not None:
        _replace(module, "bias", module.bias.index_select(0, index))
    size = module.weight.shape[dim]
    if isinstance(module, nn.Linear):
        setattr(module, "out_features" if dim == 0 else "in_features", size)
    else:  # a convolution: weight (out, in, *kernel), groups == 1 (checked when grouping)
        setattr(module, "out_channels" if dim == 0 else "in_channels", size)


def _cut_norm(module: nn.Module, keep: torch.Tensor) -> None:
    index = keep.to(next(chain(module.parameters(), module.buffers())).device)
    for name in ("weight", "bias"):
        if getattr(module, name, None) is not None:
            _replace(module, name, getattr(module, name).index_select(0, index))
    for name in ("running_mean", "running_var"):
        if getattr(module, name, None) is not None:
            setattr(module, name, getattr(module, name).index_select(0, index))
    module.num_features = len(keep)


def _replace(module: nn.Module, name: str, value: torch.Tensor) -> None:
    old = getattr(module, name)
    setattr(module, name, nn.Parameter(value.detach().clone(), requires_grad=old.requires_grad))
