"""GPT-2 124M (Radford et al. 2019; HF ``GPT2LMHeadModel``), laid out as its opset-17 export.

Embeddings: Gather(wte) + Gather(wpe, Range(0, seq)). Each pre-LN block: ln_1, c_attn one
MatMul [h, 3h] + Add then Split into Q/K/V, heads by Reshape [0,0,heads,d] + Transpose, scores
MatMul / sqrt(d), causal mask by a constant lower-triangular bool buffer [1,1,n_pos,n_pos]
sliced to [s, s] and Where(mask, scores, -1e4) (HF's ``masked_bias``), plus the padding mask
(1 - mask) * -1e4, Softmax, context MatMul, merge, c_proj, residual; ln_2, c_fc, tanh-GELU
(HF NewGELU), c_proj, residual. ln_f, then the LM head tied to wte: MatMul(x, Transpose(wte)).
Inputs ``input_ids``, ``attention_mask`` int64 [batch, seq] → ``logits`` [batch, seq, vocab].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from onnx import ModelProto, TensorProto

from kiln.zoo._builder import GraphBuilder


@dataclass(frozen=True)
class GPT2Config:
    layers: int = 12
    hidden: int = 768
    heads: int = 12
    vocab: int = 50257
    positions: int = 1024
    eps: float = 1e-5


FULL = GPT2Config()
TINY = GPT2Config(layers=2, hidden=64, heads=4, vocab=1000, positions=64)


def build(cfg: GPT2Config, zoo_name: str, dims: dict[str, int], seed: int = 0) -> ModelProto:
    g = GraphBuilder(seed)
    h, d = cfg.hidden, cfg.hidden // cfg.heads
    proj_std = 0.02 / math.sqrt(2 * cfg.layers)  # HF's scaled init of the residual projections
    ids = g.input("input_ids", TensorProto.INT64, ["batch", "seq"])
    mask = g.input("attention_mask", TensorProto.INT64, ["batch", "seq"])
    wte = g.normal("transformer.wte.weight", (cfg.vocab, h), 0.02)
    wpe = g.normal("transformer.wpe.weight", (cfg.positions, h), 0.02)
    shape = g.op("Shape", [ids], "transformer.Shape")
    seq = g.op("Gather", [shape, g.const("const.int_1", 1)], "transformer.Gather_seq", axis=0)
    pos = g.op(
        "Range",
        [g.const("const.int_0", 0), seq, g.const("const.int_1", 1)],
        "transformer.position_ids.Range",
    )
    pos = g.op(
        "Unsqueeze", [pos, g.const("const.axes_0", [0])], "transformer.position_ids.Unsqueeze"
    )
    x = g.op("Gather", [wte, ids], "transformer.wte.Gather")
    x = g.op("Add", [x, g.op("Gather", [wpe, pos], "transformer.wpe.Gather")], "transformer.Add")
    pad = g.padding_mask(mask, "transformer.attention_mask")
    tril = np.tril(np.ones((cfg.positions, cfg.positions), dtype=bool))[None, None]
    buf = g.weight("transformer.bias", tril)
    seq1 = g.op("Unsqueeze", [seq, g.const("const.axes_0", [0])], "transformer.Unsqueeze_seq")
    ends = g.op("Concat", [seq1, seq1], "transformer.causal_mask.Concat", axis=0)
    causal = g.op(
        "Slice",
        [buf, g.const("const.starts_0_0", [0, 0]), ends, g.const("const.axes_2_3", [2, 3])],
        "transformer.causal_mask.Slice",
    )
    for i in range(cfg.layers):
        name = f"transformer.h.{i}"
        y = g.layer_norm(x, f"{name}.ln_1", h, cfg.eps)
        qkv = g.linear(y, f"{name}.attn.c_attn", h, 3 * h)
        q, k, v = g.op_multi(
            "Split", [qkv, g.const("const.split_qkv", [h, h, h])], f"{name}.attn.Split", 3, axis=2
        )
        ctx = g.attention_core(q, k, v, f"{name}.attn", cfg.heads, d, pad, causal)
        y = g.linear(ctx, f"{name}.attn.c_proj", h, h, proj_std)
        x = g.op("Add", [y, x], f"{name}.Add")
        y = g.layer_norm(x, f"{name}.ln_2", h, cfg.eps)
        y = g.linear(y, f"{name}.mlp.c_fc", h, 4 * h)
        y = g.gelu_tanh(y, f"{name}.mlp.act")
        y = g.linear(y, f"{name}.mlp.c_proj", 4 * h, h, proj_std)
        x = g.op("Add", [y, x], f"{name}.Add_1")
    x = g.layer_norm(x, "transformer.ln_f", h, cfg.eps)
    head = g.op("Transpose", [wte], "lm_head.Transpose", perm=[1, 0])
    g.op("MatMul", [x, head], "lm_head.MatMul", output="logits")
    g.output("logits", TensorProto.FLOAT, ["batch", "seq", cfg.vocab])
    return g.model(zoo_name, dims)
