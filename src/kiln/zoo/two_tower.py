"""A two-tower image-text model (CLIP-style dual encoder, with BLIP's image-text matching head).

Image tower (``image.*``): a small CNN, stem Conv 3×3/2 + BN + ReLU, then stages of a strided
Conv + BN + ReLU and a Conv + BN + ReLU, GlobalAveragePool, Flatten, projection Linear to the
embedding width. Text tower (``text.*``): token + position embeddings, LayerNorm, post-LN
transformer layers as BERT's (padding mask from ``attention_mask``), masked mean pooling,
projection Linear. The towers meet only in the head (``head.*``): each embedding L2-normalised
(``image_embeds``, ``text_embeds``), their product through a small MLP to ``match_logits``
[batch, 2] (no match / match). Nothing but the head reads both towers, so the towers are
independent branches of the graph: a partitioned artifact can run them at once.

Inputs ``image`` float [batch, 3, H, W], ``input_ids`` and ``attention_mask`` int64
[batch, seq].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import ModelProto, TensorProto

from kiln.zoo._builder import GraphBuilder


@dataclass(frozen=True)
class TwoTowerConfig:
    image: int = 224
    stem: int = 32
    widths: tuple[int, ...] = (64, 128, 256, 512)  # one stage each, stride 2 on entry
    layers: int = 6
    hidden: int = 384
    heads: int = 6
    ffn: int = 1536
    vocab: int = 8192
    max_positions: int = 128
    embed: int = 256
    eps: float = 1e-12


FULL = TwoTowerConfig()
TINY = TwoTowerConfig(
    image=32, stem=8, widths=(16, 32), layers=2, hidden=32, heads=4, ffn=64, vocab=1000,
    max_positions=64, embed=16,
)  # fmt: skip


def analytic_macs(cfg: TwoTowerConfig, seq: int) -> int:
    """Multiply-accumulates of one sample at sequence length `seq` (convolutions, the
    transformer's Linear layers and attention products, projections and head)."""
    side = cfg.image // 2
    macs = side * side * 9 * 3 * cfg.stem
    cin = cfg.stem
    for width in cfg.widths:
        side = (side + 1) // 2
        macs += side * side * 9 * (cin * width + width * width)
        cin = width
    macs += cin * cfg.embed
    h = cfg.hidden
    per_layer = seq * (4 * h * h + 2 * h * cfg.ffn) + 2 * seq * seq * h
    macs += cfg.layers * per_layer + h * cfg.embed
    return macs + 2 * cfg.embed * cfg.embed


def _image_tower(g: GraphBuilder, x: str, cfg: TwoTowerConfig) -> str:
    x = g.conv_bn(x, "image.stem.conv", "image.stem.bn", 3, cfg.stem, 3, stride=2)
    cin = cfg.stem
    for i, width in enumerate(cfg.widths):
        p = f"image.stage{i + 1}"
        x = g.conv_bn(x, f"{p}.conv1", f"{p}.bn1", cin, width, 3, stride=2)
        x = g.conv_bn(x, f"{p}.conv2", f"{p}.bn2", width, width, 3)
        cin = width
    x = g.op("GlobalAveragePool", [x], "image.pool")
    x = g.op("Flatten", [x], "image.flatten", axis=1)
    return g.linear(x, "image.projection", cin, cfg.embed, std=cin**-0.5)


def _text_embeddings(g: GraphBuilder, ids: str, cfg: TwoTowerConfig) -> str:
    p, h = "text.embeddings", cfg.hidden
    word = g.normal(f"{p}.word_embeddings.weight", (cfg.vocab, h), 0.02)
    pos = g.normal(f"{p}.position_embeddings.weight", (cfg.max_positions, h), 0.02)
    x = g.op("Gather", [word, ids], f"{p}.word_embeddings.Gather")
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
        "Add", [x, g.op("Gather", [pos, pos_ids], f"{p}.position_embeddings.Gather")], f"{p}.Add"
    )
    return g.layer_norm(x, f"{p}.LayerNorm", h, cfg.eps)


def _text_tower(g: GraphBuilder, ids: str, mask: str, cfg: TwoTowerConfig) -> str:
    h, d = cfg.hidden, cfg.hidden // cfg.heads
    x = _text_embeddings(g, ids, cfg)
    ext = g.padding_mask(mask, "text.extended_attention_mask")
    for i in range(cfg.layers):
        name = f"text.layer.{i}"
        att = f"{name}.attention"
        q = g.linear(x, f"{att}.query", h, h)
        k = g.linear(x, f"{att}.key", h, h)
        v = g.linear(x, f"{att}.value", h, h)
        ctx = g.attention_core(q, k, v, att, cfg.heads, d, ext)
        y = g.linear(ctx, f"{att}.output.dense", h, h)
        y = g.op("Add", [y, x], f"{att}.output.Add")
        x = g.layer_norm(y, f"{att}.output.LayerNorm", h, cfg.eps)
        y = g.linear(x, f"{name}.intermediate.dense", h, cfg.ffn)
        y = g.gelu_erf(y, f"{name}.intermediate.gelu")
        y = g.linear(y, f"{name}.output.dense", cfg.ffn, h)
        y = g.op("Add", [y, x], f"{name}.output.Add")
        x = g.layer_norm(y, f"{name}.output.LayerNorm", h, cfg.eps)
    # Masked mean over the tokens: padding does not move the sentence's embedding.
    m = g.op("Cast", [mask], "text.pool.Cast", to=TensorProto.FLOAT)
    m = g.op("Unsqueeze", [m, g.const("const.axes_-1", [-1])], "text.pool.Unsqueeze")
    total = g.op("ReduceSum", [g.op("Mul", [x, m], "text.pool.Mul"), g.const("const.axes_1", [1])],
                 "text.pool.ReduceSum", keepdims=0)  # fmt: skip
    count = g.op("ReduceSum", [m, g.const("const.axes_1", [1])], "text.pool.Count", keepdims=0)
    count = g.op("Max", [count, g.const("const.one", 1.0)], "text.pool.Max")
    pooled = g.op("Div", [total, count], "text.pool.Div")
    return g.linear(pooled, "text.projection", h, cfg.embed, std=h**-0.5)


def _normalize(g: GraphBuilder, x: str, name: str, output: str) -> str:
    norm = g.op("ReduceL2", [x], f"{name}.ReduceL2", axes=[-1], keepdims=1)
    norm = g.op("Max", [norm, g.const("const.tiny", 1e-12)], f"{name}.Max")
    return g.op("Div", [x, norm], f"{name}.Div", output=output)


def build(cfg: TwoTowerConfig, zoo_name: str, dims: dict[str, int], seed: int = 0) -> ModelProto:
    g = GraphBuilder(seed)
    img = g.input("image", TensorProto.FLOAT, ["batch", 3, cfg.image, cfg.image])
    ids = g.input("input_ids", TensorProto.INT64, ["batch", "seq"])
    mask = g.input("attention_mask", TensorProto.INT64, ["batch", "seq"])
    image = _normalize(g, _image_tower(g, img, cfg), "head.image_norm", "image_embeds")
    text = _normalize(g, _text_tower(g, ids, mask, cfg), "head.text_norm", "text_embeds")
    # Matching head: the embeddings' product (elements ~1/embed), scaled to order one, an MLP.
    joint = g.op("Mul", [image, text], "head.Mul")
    joint = g.op("Mul", [joint, g.const("const.logit_scale", float(cfg.embed))], "head.scale")
    y = g.linear(joint, "head.fc1", cfg.embed, cfg.embed, std=cfg.embed**-0.5)
    y = g.op("Relu", [y], "head.Relu")
    g.linear(y, "head.fc2", cfg.embed, 2, std=cfg.embed**-0.5, output="match_logits")
    g.output("image_embeds", TensorProto.FLOAT, ["batch", cfg.embed])
    g.output("text_embeds", TensorProto.FLOAT, ["batch", cfg.embed])
    g.output("match_logits", TensorProto.FLOAT, ["batch", 2])
    return g.model(zoo_name, dims)
