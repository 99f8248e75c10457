"""BERT-base (Devlin et al. 2019; HF ``BertModel``), laid out as its opset-17 TorchScript export.

Embeddings: Gather(word) + Gather(position, ids sliced from a [1, max_pos] buffer to the input's
length) + Gather(token type), LayerNorm (eps 1e-12). Extended mask: (1 - Cast(Unsqueeze(mask)))
* -10000. Each of the encoder layers: Q/K/V Linear (MatMul + Add), heads split by Reshape
[0,0,h,d] + Transpose, scores MatMul / sqrt(d) + mask, Softmax, context MatMul, merge, output
Linear + residual + LayerNorm, FFN Linear + erf-GELU + Linear + residual + LayerNorm. Pooler:
first token, Linear, Tanh. Inputs ``input_ids``, ``attention_mask``, ``token_type_ids`` int64
[batch, seq] → ``last_hidden_state`` [batch, seq, hidden], ``pooler_output`` [batch, hidden].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import ModelProto, TensorProto

from kiln.zoo._builder import GraphBuilder


@dataclass(frozen=True)
class BertConfig:
    layers: int = 12
    hidden: int = 768
    heads: int = 12
    ffn: int = 3072
    vocab: int = 30522
    max_positions: int = 512
    type_vocab: int = 2
    eps: float = 1e-12


FULL = BertConfig()
# bert-base with a long-context position table (Longformer extends RoBERTa's 512 rows to 4,096
# the same way); everything else is FULL's, so one graph serves any seq up to 4,096 tokens.
LONG = BertConfig(max_positions=4096)
TINY = BertConfig(layers=2, hidden=64, heads=4, ffn=256, vocab=1000, max_positions=64)


def _embeddings(g: GraphBuilder, ids: str, types: str, cfg: BertConfig) -> str:
    """Word + token type + position embeddings, then LayerNorm."""
    p, h = "embeddings", cfg.hidden
    word = g.normal(f"{p}.word_embeddings.weight", (cfg.vocab, h), 0.02)
    pos = g.normal(f"{p}.position_embeddings.weight", (cfg.max_positions, h), 0.02)
    tt = g.normal(f"{p}.token_type_embeddings.weight", (cfg.type_vocab, h), 0.02)
    x = g.op("Gather", [word, ids], f"{p}.word_embeddings.Gather")
    t = g.op("Gather", [tt, types], f"{p}.token_type_embeddings.Gather")
    x = g.op("Add", [x, t], f"{p}.Add")
    shape = g.op("Shape", [ids], f"{p}.Shape")
    seq = g.op("Gather", [shape, g.const("const.int_1", 1)], f"{p}.Gather_seq", axis=0)
    seq = g.op("Unsqueeze", [seq, g.const("const.axes_0", [0])], f"{p}.Unsqueeze_seq")
    buf = g.weight(f"{p}.position_ids", np.arange(cfg.max_positions, dtype=np.int64)[None])
    pos_ids = g.op(
        "Slice",
        [buf, g.const("const.starts_0", [0]), seq, g.const("const.axes_1", [1])],
        f"{p}.position_ids.Slice",
    )
    x = g.op(
        "Add", [x, g.op("Gather", [pos, pos_ids], f"{p}.position_embeddings.Gather")], f"{p}.Add_1"
    )
    return g.layer_norm(x, f"{p}.LayerNorm", h, cfg.eps)


def build(cfg: BertConfig, zoo_name: str, dims: dict[str, int], seed: int = 0) -> ModelProto:
    g = GraphBuilder(seed)
    h, d = cfg.hidden, cfg.hidden // cfg.heads
    ids = g.input("input_ids", TensorProto.INT64, ["batch", "seq"])
    mask = g.input("attention_mask", TensorProto.INT64, ["batch", "seq"])
    types = g.input("token_type_ids", TensorProto.INT64, ["batch", "seq"])
    x = _embeddings(g, ids, types, cfg)
    ext = g.padding_mask(mask, "extended_attention_mask")
    for i in range(cfg.layers):
        name = f"encoder.layer.{i}"
        att = f"{name}.attention"
        q = g.linear(x, f"{att}.self.query", h, h)
        k = g.linear(x, f"{att}.self.key", h, h)
        v = g.linear(x, f"{att}.self.value", h, h)
        ctx = g.attention_core(q, k, v, f"{att}.self", cfg.heads, d, ext)
        y = g.linear(ctx, f"{att}.output.dense", h, h)
        y = g.op("Add", [y, x], f"{att}.output.Add")
        x = g.layer_norm(y, f"{att}.output.LayerNorm", h, cfg.eps)
        y = g.linear(x, f"{name}.intermediate.dense", h, cfg.ffn)
        y = g.gelu_erf(y, f"{name}.intermediate.gelu")
        y = g.linear(y, f"{name}.output.dense", cfg.ffn, h)
        y = g.op("Add", [y, x], f"{name}.output.Add")
        last = "last_hidden_state" if i == cfg.layers - 1 else None
        x = g.layer_norm(y, f"{name}.output.LayerNorm", h, cfg.eps, output=last)
    first = g.op("Gather", [x, g.const("const.int_0", 0)], "pooler.Gather", axis=1)
    pooled = g.linear(first, "pooler.dense", h, h)
    g.op("Tanh", [pooled], "pooler.Tanh", output="pooler_output")
    g.output("last_hidden_state", TensorProto.FLOAT, ["batch", "seq", h])
    g.output("pooler_output", TensorProto.FLOAT, ["batch", h])
    return g.model(zoo_name, dims)
