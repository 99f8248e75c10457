"""3-D U-Net (after Çiçek et al. 2016, in the common "double conv" form).

Exact configuration of ``unet3d`` (``unet3d-tiny`` is the same with a 16³ volume and base 4):

- input ``input`` [batch, 1, 64, 64, 64]; output ``logits`` [batch, 2, 64, 64, 64];
- a *double conv* block is (Conv3d 3×3×3, padding 1, no bias → BatchNormalization → Relu) × 2,
  the first conv going from the block's input channels straight to its output channels;
- encoder: double conv 1→16 at 64³; then ``depth`` = 3 levels, each MaxPool3d 2×2×2/2 followed
  by a double conv doubling the channels: 16→32 at 32³, 32→64 at 16³, 64→128 at 8³ (the last is
  the bottleneck);
- decoder, 3 levels: ConvTranspose3d 2×2×2/2 with bias halving the channels (128→64 to 16³,
  64→32 to 32³, 32→16 to 64³), Concat([skip, up], axis=1) doubling them back, then a double conv
  halving them (128→64, 64→32, 32→16);
- head: Conv3d 1×1×1 with bias, 16 → 2 classes.

Multiply-accumulates at batch 1 (V = output voxels, k = 27 for 3×3×3, 8 for the 2×2×2
transposed convs counted per input voxel): 8.38 M (head) + encoder 64³: 262144·27·(1·16 +
16·16) + 32³: 32768·27·(16·32 + 32·32) + 16³: 4096·27·(32·64 + 64·64) + 8³: 512·27·(64·128 +
128·128) + up-convs: 512·8·128·64 + 4096·8·64·32 + 32768·8·32·16 + decoder double convs
16³: 4096·27·(128·64 + 64·64) + 32³: 32768·27·(64·32 + 32·32) + 64³: 262144·27·(32·16 + 16·16)
= 14,059,307,008 MAC ≈ 28.12 GFLOPs; see ``analytic_macs``.
"""

from __future__ import annotations

from dataclasses import dataclass

from onnx import ModelProto, TensorProto

from kiln.zoo._builder import GraphBuilder


@dataclass(frozen=True)
class UNet3DConfig:
    volume: int = 64
    in_channels: int = 1
    base: int = 16
    depth: int = 3  # number of down-sampling levels
    classes: int = 2


FULL = UNet3DConfig()
TINY = UNet3DConfig(volume=16, base=4)


def analytic_macs(cfg: UNet3DConfig) -> int:
    """Multiply-accumulates of one sample, from the configuration alone (not the graph)."""

    def double(vox: int, cin: int, cout: int) -> int:
        return vox * 27 * (cin * cout + cout * cout)

    vox = [(cfg.volume // 2**i) ** 3 for i in range(cfg.depth + 1)]
    ch = [cfg.base * 2**i for i in range(cfg.depth + 1)]
    macs = double(vox[0], cfg.in_channels, ch[0])
    macs += sum(double(vox[i], ch[i - 1], ch[i]) for i in range(1, cfg.depth + 1))
    for i in range(cfg.depth, 0, -1):
        macs += vox[i] * 8 * ch[i] * ch[i - 1]  # ConvTranspose3d, per input voxel
        macs += double(vox[i - 1], 2 * ch[i - 1], ch[i - 1])
    return macs + vox[0] * ch[0] * cfg.classes


def _double(g: GraphBuilder, x: str, name: str, cin: int, cout: int) -> str:
    x = g.conv_bn(x, f"{name}.conv1", f"{name}.bn1", cin, cout, 3, nd=3)
    return g.conv_bn(x, f"{name}.conv2", f"{name}.bn2", cout, cout, 3, nd=3)


def build(cfg: UNet3DConfig, zoo_name: str, dims: dict[str, int], seed: int = 0) -> ModelProto:
    g = GraphBuilder(seed)
    v = cfg.volume
    x = g.input("input", TensorProto.FLOAT, ["batch", cfg.in_channels, v, v, v])
    ch = [cfg.base * 2**i for i in range(cfg.depth + 1)]
    x = _double(g, x, "encoder.0", cfg.in_channels, ch[0])
    skips = [x]
    for i in range(1, cfg.depth + 1):
        x = g.op("MaxPool", [x], f"encoder.{i}.pool", kernel_shape=[2] * 3, strides=[2] * 3)
        x = _double(g, x, f"encoder.{i}", ch[i - 1], ch[i])
        skips.append(x)
    skips.pop()  # the bottleneck output is not a skip
    for level, i in enumerate(range(cfg.depth, 0, -1)):
        name = f"decoder.{level}"
        # each output voxel sees one tap per input channel: fan-in = ch[i]
        w = g.normal(f"{name}.up.weight", (ch[i], ch[i - 1], 2, 2, 2), (1.0 / ch[i]) ** 0.5)
        b = g.normal(f"{name}.up.bias", (ch[i - 1],), 0.02)
        x = g.op("ConvTranspose", [x, w, b], f"{name}.up", kernel_shape=[2] * 3, strides=[2] * 3)
        x = g.op("Concat", [skips.pop(), x], f"{name}.Concat", axis=1)
        x = _double(g, x, name, 2 * ch[i - 1], ch[i - 1])
    g.conv(x, "head", ch[0], cfg.classes, 1, bias=True, nd=3, output="logits")
    g.output("logits", TensorProto.FLOAT, ["batch", cfg.classes, v, v, v])
    return g.model(zoo_name, dims)
