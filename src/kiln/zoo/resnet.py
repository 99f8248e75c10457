"""ResNet-50 (torchvision ``resnet50``: bottleneck v1.5, stride on the 3×3 conv).

conv1 7×7/2 (64) + BN + ReLU, MaxPool 3×3/2, four stages of bottlenecks [3, 4, 6, 3] with widths
64/128/256/512 and expansion 4 (a 1×1/stride conv + BN on the shortcut where the shape changes),
GlobalAveragePool, Flatten, Gemm (fc). Every Conv is followed by a separate BatchNormalization
(and Relu), so a compiler can fold them. Input ``input`` [batch, 3, H, W] → ``logits``
[batch, classes].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import onnx
from onnx import TensorProto

from kiln.zoo._builder import GraphBuilder


@dataclass(frozen=True)
class ResNetConfig:
    layers: tuple[int, ...] = (3, 4, 6, 3)
    width: int = 64  # channels of the stem and of the first stage's bottleneck
    image: int = 224
    classes: int = 1000
    # Scale of the last BN gamma of each residual branch: keeps the residual stream bounded
    # with random weights (the role torchvision's zero_init_residual plays for training).
    residual_gamma: float = 0.2


FULL = ResNetConfig()
TINY = ResNetConfig(layers=(1, 1, 1, 1), width=8, image=32, classes=10)


def _bottleneck(
    g: GraphBuilder, x: str, name: str, cin: int, width: int, stride: int, cfg: ResNetConfig
) -> str:
    cout = width * 4
    y = g.conv_bn(x, f"{name}.conv1", f"{name}.bn1", cin, width, 1)
    y = g.conv_bn(y, f"{name}.conv2", f"{name}.bn2", width, width, 3, stride)
    y = g.conv_bn(
        y, f"{name}.conv3", f"{name}.bn3", width, cout, 1, act=None, gamma=cfg.residual_gamma
    )
    if stride != 1 or cin != cout:
        x = g.conv_bn(
            x, f"{name}.downsample.0", f"{name}.downsample.1", cin, cout, 1, stride, act=None
        )
    y = g.op("Add", [y, x], f"{name}.Add")
    return g.op("Relu", [y], f"{name}.Relu")


def build(cfg: ResNetConfig, zoo_name: str, dims: dict[str, int], seed: int = 0) -> onnx.ModelProto:
    g = GraphBuilder(seed)
    x = g.input("input", TensorProto.FLOAT, ["batch", 3, cfg.image, cfg.image])
    x = g.conv(x, "conv1", 3, cfg.width, 7, stride=2, pad=3)
    x = g.batch_norm(x, "bn1", cfg.width)
    x = g.op("Relu", [x], "relu")
    x = g.op("MaxPool", [x], "maxpool", kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1])
    cin = cfg.width
    for stage, blocks in enumerate(cfg.layers):
        width = cfg.width * 2**stage
        for i in range(blocks):
            stride = 2 if stage > 0 and i == 0 else 1
            x = _bottleneck(g, x, f"layer{stage + 1}.{i}", cin, width, stride, cfg)
            cin = width * 4
    x = g.op("GlobalAveragePool", [x], "avgpool")
    x = g.op("Flatten", [x], "flatten", axis=1)
    bound = 1.0 / math.sqrt(cin)
    w = g.uniform("fc.weight", (cfg.classes, cin), -bound, bound)  # nn.Linear's default init
    b = g.uniform("fc.bias", (cfg.classes,), -bound, bound)
    g.op("Gemm", [x, w, b], "fc", output="logits", transB=1)
    g.output("logits", TensorProto.FLOAT, ["batch", cfg.classes])
    return g.model(zoo_name, dims)
