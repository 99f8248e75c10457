"""Built-in model architectures, authored in code with seeded weights (opset 17, default domain).

Each full-size model has a ``-tiny`` twin built by the same code with a small configuration,
for tests (``bert-base-4k``, bert-base with 4,096 positions, shares ``bert-tiny``). ``build``
is deterministic: the same name gives the same bytes on every call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import onnx

from kiln.errors import KilnError
from kiln.zoo import bert, gpt2, mobilenet, resnet, two_tower, unet3d, vit


@dataclass(frozen=True)
class ZooEntry:
    name: str
    description: str
    dims: dict[str, int]  # defaults for the symbolic dims
    published_gflops: float | None  # GFLOPs = 2 × MACs at ``dims``; None if no figure
    published_source: str  # where the figure comes from, or how it was derived
    tiny: bool


_Builder = Callable[[str, dict[str, int]], onnx.ModelProto]

_GPT2_SOURCE = (
    "derived: 2·N·s + 2·L·s²·d·2 + 2·s·d·V with N = 12·L·d² = 84,934,656 non-embedding "
    "weights, L = 12, d = 768, s = 128, V = 50257 (Kaplan et al. 2020 forward-pass count)"
)
_BERT_SOURCE = (
    "derived: 2·s·12·L·d² + 2·L·s²·d·2 + 2·d² (pooler), L = 12, d = 768, s = 128 "
    "= 11.174 GMAC; matches the widely quoted 22.3 GFLOPs for BERT-base at seq 128"
)
_BERT_4K_SOURCE = (
    "derived as for bert-base (2·s·12·L·d² + 2·L·s²·d·2 + 2·d², L = 12, d = 768) at s = 4096 "
    "= 657.13 GMAC, 47 % of it in the attention's s² products"
)

_ENTRIES: dict[str, tuple[ZooEntry, _Builder]] = {}


def _add(
    name: str,
    description: str,
    dims: dict[str, int],
    gflops: float | None,
    source: str,
    builder: _Builder,
) -> None:
    entry_ = ZooEntry(name, description, dict(dims), gflops, source, name.endswith("-tiny"))
    _ENTRIES[name] = (entry_, builder)


_IMG = {"batch": 1}
_TXT = {"batch": 1, "seq": 128}
_TXT_4K = {"batch": 1, "seq": 4096}
_TXT_TINY = {"batch": 1, "seq": 16}
_TWO_TOWER = {"batch": 1, "seq": 64}

_add(
    "resnet50",
    "ResNet-50 v1.5 (torchvision), 224², 1000 classes",
    _IMG,
    8.18,
    "torchvision ResNet50_Weights.IMAGENET1K_V1: 4.09 GMAC",
    lambda n, d: resnet.build(resnet.FULL, n, d),
)
_add(
    "mobilenetv2",
    "MobileNetV2 width 1.0, 224², ReLU6, 1000 classes",
    _IMG,
    0.60,
    "Sandler et al. 2018 (Table 3): 300 M multiply-adds; torchvision 0.30 GMAC",
    lambda n, d: mobilenet.build(mobilenet.FULL, n, d),
)
_add(
    "bert-base",
    "BERT-base uncased encoder + pooler (12 × 768, 12 heads), seq 128",
    _TXT,
    22.35,
    _BERT_SOURCE,
    lambda n, d: bert.build(bert.FULL, n, d),
)
_add(
    "bert-base-4k",
    "BERT-base encoder + pooler with 4,096 position embeddings (long context), seq 4096",
    _TXT_4K,
    1314.26,
    _BERT_4K_SOURCE,
    lambda n, d: bert.build(bert.LONG, n, d),
)
_add(
    "gpt2",
    "GPT-2 124M with tied LM head (12 × 768, 12 heads, vocab 50257), seq 128",
    _TXT,
    32.23,
    _GPT2_SOURCE,
    lambda n, d: gpt2.build(gpt2.FULL, n, d),
)
_add(
    "unet3d",
    "3-D U-Net, 1×64³ → 2 classes, depth 3, base 16 (see kiln.zoo.unet3d)",
    _IMG,
    2 * unet3d.analytic_macs(unet3d.FULL) / 1e9,
    "derived analytically from the configuration (kiln.zoo.unet3d.analytic_macs): 14.06 GMAC",
    lambda n, d: unet3d.build(unet3d.FULL, n, d),
)
_add(
    "vit-b16",
    "ViT-B/16, 224², 12 × 768, 12 heads, MLP 3072, 1000 classes",
    _IMG,
    35.12,
    "timm / torchvision vit_b_16: 17.56 GMAC",
    lambda n, d: vit.build(vit.FULL, n, d),
)

_add(
    "two-tower",
    "two-tower image-text model: CNN image tower 224², 6 × 384 text tower, seq 64, ITM head",
    _TWO_TOWER,
    2 * two_tower.analytic_macs(two_tower.FULL, _TWO_TOWER["seq"]) / 1e9,
    "derived analytically from the configuration (kiln.zoo.two_tower.analytic_macs)",
    lambda n, d: two_tower.build(two_tower.FULL, n, d),
)

_add(
    "resnet-tiny",
    "ResNet bottleneck net, 32², blocks [1,1,1,1], width 8, 10 classes",
    _IMG,
    None,
    "",
    lambda n, d: resnet.build(resnet.TINY, n, d),
)
_add(
    "mobilenetv2-tiny",
    "MobileNetV2 width 0.25, 4 stages, 32², 10 classes",
    _IMG,
    None,
    "",
    lambda n, d: mobilenet.build(mobilenet.TINY, n, d),
)
_add(
    "bert-tiny",
    "BERT, 2 × 64, 4 heads, vocab 1000, seq 16",
    _TXT_TINY,
    None,
    "",
    lambda n, d: bert.build(bert.TINY, n, d),
)
_add(
    "gpt2-tiny",
    "GPT-2, 2 × 64, 4 heads, vocab 1000, 64 positions, seq 16",
    _TXT_TINY,
    None,
    "",
    lambda n, d: gpt2.build(gpt2.TINY, n, d),
)
_add(
    "unet3d-tiny",
    "3-D U-Net, 1×16³ → 2 classes, depth 3, base 4",
    _IMG,
    None,
    "",
    lambda n, d: unet3d.build(unet3d.TINY, n, d),
)
_add(
    "two-tower-tiny",
    "two-tower image-text model: CNN tower 32², 2 × 32 text tower, seq 16",
    _TXT_TINY,
    None,
    "",
    lambda n, d: two_tower.build(two_tower.TINY, n, d),
)
_add(
    "vit-tiny",
    "ViT, 32², patch 8, 2 × 64, 4 heads, MLP 256, 10 classes",
    _IMG,
    None,
    "",
    lambda n, d: vit.build(vit.TINY, n, d),
)


def names() -> list[str]:
    """All zoo models, full-size first."""
    return [n for n, (e, _) in _ENTRIES.items() if not e.tiny] + [
        n for n, (e, _) in _ENTRIES.items() if e.tiny
    ]


def entry(name: str) -> ZooEntry:
    """The entry for ``name``; KilnError naming the known models if there is none."""
    if name not in _ENTRIES:
        raise KilnError(f"unknown zoo model {name!r}; known models: {', '.join(names())}")
    return _ENTRIES[name][0]


def build(name: str) -> onnx.ModelProto:
    """Build ``name`` with its seeded weights (same bytes on every call)."""
    e = entry(name)
    return _ENTRIES[name][1](name, dict(e.dims))


__all__ = ["ZooEntry", "build", "entry", "names"]
