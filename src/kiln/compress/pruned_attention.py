"""nn.MultiheadAttention's interface for attention that has lost some of its heads.

nn.MultiheadAttention ties its inner width to its embedding width (num_heads * head_dim ==
embed_dim), so it cannot hold fewer heads. `HeadPrunedAttention` keeps the same call
signature and results with separate q/k/v/out projections whose inner width is
num_heads * head_dim, whatever num_heads has become.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class HeadPrunedAttention(nn.Module):
    """Attention with `num_heads` heads of `head_dim` each, called like nn.MultiheadAttention."""

    # torch's fused paths (TransformerEncoderLayer, TransformerEncoder) read the packed
    # in_proj tensors and assume the full width; these values make them take the plain path.
    _qkv_same_embed_dim = False
    in_proj_weight = None
    in_proj_bias = None

    def __init__(self, source: nn.MultiheadAttention) -> None:
        super().__init__()
        self.embed_dim, self.kdim, self.vdim = source.embed_dim, source.kdim, source.vdim
        self.num_heads, self.head_dim = source.num_heads, source.head_dim
        self.batch_first, self.dropout = source.batch_first, source.dropout
        weights = _projections(source)
        biases = _split_bias(source.in_proj_bias)
        inputs = (self.embed_dim, self.kdim, self.vdim)
        self.q_proj, self.k_proj, self.v_proj = (
            _linear(w, b, n) for w, b, n in zip(weights, biases, inputs, strict=True)
        )
        self.out_proj = source.out_proj
        # Original head numbers of the heads still here: a per-head (batch*heads, L, S) mask
        # written for the full model is cut down to them.
        self.register_buffer("kept_heads", torch.arange(source.num_heads), persistent=False)
        self.original_heads = source.num_heads

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batched = query.dim() == 3
        if not batched:
            query, key, value = (t.unsqueeze(0) for t in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        batch, length, source = query.shape[0], query.shape[1], key.shape[1]
        q, k, v = (
            self._heads(proj(t), batch)
            for proj, t in ((self.q_proj, query), (self.k_proj, key), (self.v_proj, value))
        )
        mask = self._mask(attn_mask, key_padding_mask, batch, length, source, q.dtype)
        causal = is_causal and mask is None
        dropout = self.dropout if self.training else 0.0
        if need_weights:
            out, weights = _attend(q, k, v, mask, causal, dropout)
            if average_attn_weights:
                weights = weights.mean(dim=1)
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal
            )
            weights = None
        out = self.out_proj(out.transpose(1, 2).reshape(batch, length, -1))
        if not batched:
            return out.squeeze(0), None if weights is None else weights.squeeze(0)
        return (out if self.batch_first else out.transpose(0, 1)), weights

    def _heads(self, x: torch.Tensor, batch: int) -> torch.Tensor:
        return x.reshape(batch, -1, self.num_heads, self.head_dim).transpose(1, 2)

    def _mask(
        self,
        attn_mask: torch.Tensor | None,
        padding: torch.Tensor | None,
        batch: int,
        length: int,
        source: int,
        dtype: torch.dtype,
    ) -> torch.Tensor | None:
        """One additive mask broadcastable to (batch, heads, length, source), or None."""
        mask = None
        if attn_mask is not None:
            mask = _additive(attn_mask, dtype)
            if mask.dim() == 3:  # (batch * original heads, L, S): keep the surviving heads
                mask = mask.reshape(batch, self.original_heads, length, source)
                mask = mask.index_select(1, self.kept_heads)
        if padding is not None:
            pad = _additive(padding, dtype).reshape(batch, 1, 1, source)
            mask = pad if mask is None else mask + pad
        return mask


def _attend(q, k, v, mask, causal: bool, dropout: float):
    """Attention that also returns the per-head weights (batch, heads, L, S)."""
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        length, source = scores.shape[-2:]
        upper = torch.ones(length, source, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(upper, float("-inf"))
    if mask is not None:
        scores = scores + mask
    weights = F.dropout(scores.softmax(dim=-1), p=dropout, training=dropout > 0)
    return weights @ v, weights


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if mask.dtype == torch.bool:  # True means "may not attend"
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            mask, float("-inf")
        )
    return mask.to(dtype)


def _projections(source: nn.MultiheadAttention) -> tuple[torch.Tensor, ...]:
    if source.in_proj_weight is not None:
        return tuple(source.in_proj_weight.chunk(3, dim=0))
    return source.q_proj_weight, source.k_proj_weight, source.v_proj_weight


def _split_bias(bias: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
    return (None, None, None) if bias is None else tuple(bias.chunk(3))


def _linear(weight: torch.Tensor, bias: torch.Tensor | None, inputs: int) -> nn.Linear:
    # Built on the meta device, so that no random initialisation runs (or moves the seed).
    layer = nn.Linear(inputs, weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight.detach().clone())
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach().clone())
    return layer
