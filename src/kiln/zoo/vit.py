"""ViT-B/16 (Dosovitskiy et al. 2021; HF ``ViTForImageClassification`` / timm
``vit_base_patch16_224``), laid out as its opset-17 export.

Patch embedding Conv 16×16/16 (3 → hidden), Reshape [0, hidden, -1], Transpose to tokens, class
token Expand-ed to the batch and Concat-ed in front, learned position embedding Add. Each pre-LN
layer (eps 1e-6): LayerNorm, Q/K/V Linear, heads by Reshape [0,0,heads,d] + Transpose, scores
MatMul / sqrt(d), Softmax, context MatMul, merge, output Linear, residual; LayerNorm, MLP Linear +
erf-GELU + Linear, residual. Final LayerNorm, class token, Linear head. Input ``pixel_values``
[batch, 3, H, W] → ``logits`` [batch, classes].
"""

from __future__ import annotations

from dataclasses import dataclass

from onnx import ModelProto, TensorProto

from kiln.zoo._builder import GraphBuilder


@dataclass(frozen=True)
class ViTConfig:
    image: int = 224
    patch: int = 16
    layers: int = 12
    hidden: int = 768
    heads: int = 12
    mlp: int = 3072
    classes: int = 1000
    eps: float = 1e-6


FULL = ViTConfig()
TINY = ViTConfig(image=32, patch=8, layers=2, hidden=64, heads=4, mlp=256, classes=10)


def build(cfg: ViTConfig, zoo_name: str, dims: dict[str, int], seed: int = 0) -> ModelProto:
    g = GraphBuilder(seed)
    h, d = cfg.hidden, cfg.hidden // cfg.heads
    tokens = (cfg.image // cfg.patch) ** 2 + 1
    px = g.input("pixel_values", TensorProto.FLOAT, ["batch", 3, cfg.image, cfg.image])
    p = "embeddings"
    x = g.conv(
        px,
        f"{p}.patch_embeddings.projection",
        3,
        h,
        cfg.patch,
        stride=cfg.patch,
        bias=True,
        std=0.02,
    )
    x = g.op(
        "Reshape",
        [x, g.const(f"const.shape_0_{h}_-1", [0, h, -1])],
        f"{p}.patch_embeddings.Reshape",
    )
    x = g.op("Transpose", [x], f"{p}.patch_embeddings.Transpose", perm=[0, 2, 1])
    cls = g.normal(f"{p}.cls_token", (1, 1, h), 0.02)
    shape = g.op("Shape", [px], f"{p}.Shape")
    batch = g.op(
        "Slice",
        [shape, g.const("const.starts_0", [0]), g.const("const.ends_1", [1])],
        f"{p}.Slice_batch",
    )
    eshape = g.op("Concat", [batch, g.const("const.ones_2", [1, 1])], f"{p}.Concat_shape", axis=0)
    cls = g.op("Expand", [cls, eshape], f"{p}.cls_token.Expand")
    x = g.op("Concat", [cls, x], f"{p}.Concat", axis=1)
    pos = g.normal(f"{p}.position_embeddings", (1, tokens, h), 0.02)
    x = g.op("Add", [x, pos], f"{p}.Add")
    for i in range(cfg.layers):
        name = f"encoder.layer.{i}"
        att = f"{name}.attention"
        y = g.layer_norm(x, f"{name}.layernorm_before", h, cfg.eps)
        q = g.linear(y, f"{att}.attention.query", h, h)
        k = g.linear(y, f"{att}.attention.key", h, h)
        v = g.linear(y, f"{att}.attention.value", h, h)
        ctx = g.attention_core(q, k, v, f"{att}.attention", cfg.heads, d, None)
        y = g.linear(ctx, f"{att}.output.dense", h, h)
        x = g.op("Add", [y, x], f"{name}.Add")
        y = g.layer_norm(x, f"{name}.layernorm_after", h, cfg.eps)
        y = g.linear(y, f"{name}.intermediate.dense", h, cfg.mlp)
        y = g.gelu_erf(y, f"{name}.intermediate.gelu")
        y = g.linear(y, f"{name}.output.dense", cfg.mlp, h)
        x = g.op("Add", [y, x], f"{name}.Add_1")
    x = g.layer_norm(x, "layernorm", h, cfg.eps)
    x = g.op("Gather", [x, g.const("const.int_0", 0)], "classifier.Gather", axis=1)
    g.linear(x, "classifier", h, cfg.classes, output="logits")
    g.output("logits", TensorProto.FLOAT, ["batch", cfg.classes])
    return g.model(zoo_name, dims)
