"""MobileNetV2 (Sandler et al. 2018; torchvision ``mobilenet_v2``, width multiplier 1.0).

Stem Conv 3×3/2 (32) + BN + ReLU6 (Clip 0..6), 17 inverted residual blocks (expansion t,
channels c, repeats n, stride s): (1,16,1,1) (6,24,2,2) (6,32,3,2) (6,64,4,2) (6,96,3,1)
(6,160,3,2) (6,320,1,1) — each a 1×1 expand Conv+BN+ReLU6 (skipped when t = 1), a depthwise 3×3
Conv (group = channels)+BN+ReLU6 and a linear 1×1 project Conv+BN, with a residual Add when
stride 1 and channels match — then Conv 1×1 (1280)+BN+ReLU6, GlobalAveragePool, Flatten,
Gemm (classifier). Input ``input`` [batch, 3, H, W] → ``logits`` [batch, classes].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from onnx import ModelProto, TensorProto

from kiln.zoo._builder import GraphBuilder

_SETTINGS = (
    (1, 16, 1, 1),
    (6, 24, 2, 2),
    (6, 32, 3, 2),
    (6, 64, 4, 2),
    (6, 96, 3, 1),
    (6, 160, 3, 2),
    (6, 320, 1, 1),
)


@dataclass(frozen=True)
class MobileNetV2Config:
    width_mult: float = 1.0
    settings: tuple[tuple[int, int, int, int], ...] = _SETTINGS
    last_channel: int = 1280
    image: int = 224
    classes: int = 1000


FULL = MobileNetV2Config()
TINY = MobileNetV2Config(
    width_mult=0.25,
    settings=((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 1, 2), (6, 64, 1, 2)),
    last_channel=64,
    image=32,
    classes=10,
)


def _divisible(v: float, divisor: int = 8) -> int:
    """torchvision's ``_make_divisible``."""
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < 0.9 * v else new_v


def build(cfg: MobileNetV2Config, zoo_name: str, dims: dict[str, int], seed: int = 0) -> ModelProto:
    g = GraphBuilder(seed)
    x = g.input("input", TensorProto.FLOAT, ["batch", 3, cfg.image, cfg.image])
    cin = _divisible(32 * cfg.width_mult)
    x = g.conv_bn(x, "features.0.0", "features.0.1", 3, cin, 3, 2, act="Relu6")
    idx = 1
    for t, c, n, s in cfg.settings:
        cout = _divisible(c * cfg.width_mult)
        for i in range(n):
            stride = s if i == 0 else 1
            name = f"features.{idx}.conv"
            hidden = cin * t
            y, j = x, 0
            if t != 1:
                y = g.conv_bn(y, f"{name}.{j}.0", f"{name}.{j}.1", cin, hidden, 1, act="Relu6")
                j += 1
            y = g.conv_bn(
                y,
                f"{name}.{j}.0",
                f"{name}.{j}.1",
                hidden,
                hidden,
                3,
                stride,
                group=hidden,
                act="Relu6",
            )
            y = g.conv_bn(
                y, f"{name}.{j + 1}", f"{name}.{j + 2}", hidden, cout, 1, act=None, gamma=0.5
            )
            if stride == 1 and cin == cout:
                y = g.op("Add", [x, y], f"features.{idx}.Add")
            x, cin = y, cout
            idx += 1
    last = _divisible(cfg.last_channel * max(1.0, cfg.width_mult))
    x = g.conv_bn(x, f"features.{idx}.0", f"features.{idx}.1", cin, last, 1, act="Relu6")
    x = g.op("GlobalAveragePool", [x], "avgpool")
    x = g.op("Flatten", [x], "flatten", axis=1)
    w = g.normal("classifier.1.weight", (cfg.classes, last), 1.0 / math.sqrt(last))
    b = g.normal("classifier.1.bias", (cfg.classes,), 0.01)
    g.op("Gemm", [x, w, b], "classifier.1", output="logits", transB=1)
    g.output("logits", TensorProto.FLOAT, ["batch", cfg.classes])
    return g.model(zoo_name, dims)
