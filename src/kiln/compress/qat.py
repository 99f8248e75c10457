"""Quantization-aware training: int8 rounding simulated in the forward pass while fine-tuning,
so the weights learn to live with it; the result exports to a QDQ ONNX graph that Kiln compiles
as already quantized (its int8 artifact keeps the trained scales).

torch.ao's FX graph mode does the work (`prepare_qat_fx`): BatchNorm is folded into the convs
first (an int8 artifact runs folded convs), then fake-quantizers go on the inputs and weights of
every Conv and Linear: activations uint8 per tensor, weights int8 symmetric per output channel
— the scheme ONNX Runtime's int8 kernels (QLinearConv, MatMulInteger) run. On an x86 CPU
without VNNI those kernels multiply uint8 by int8 with VPMADDUBSW, whose pairwise int16 sums
saturate: full-range weights there lost the CNN 5–33 points of what the same QDQ graph scores
unfused, so weights are trained to 7 bits (−64…63) on such hosts. After training each
fake-quantizer is frozen into a plain `fake_quantize_*` call with constant scales, which the
ONNX exporter writes as a QuantizeLinear/DequantizeLinear pair.
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import nn
from torch.ao.quantization import (
    FakeQuantize,
    MovingAverageMinMaxObserver,
    MovingAveragePerChannelMinMaxObserver,
    QConfig,
    QConfigMapping,
    disable_observer,
)
from torch.fx.experimental.optimization import fuse

from kiln.compress.data import Dataset
from kiln.compress.train import Recipe, Tick, fit
from kiln.errors import KilnError
from kiln.hardware import cpu_info

ACTIVATION = FakeQuantize.with_args(
    observer=MovingAverageMinMaxObserver, quant_min=0, quant_max=255, dtype=torch.quint8,
    qscheme=torch.per_tensor_affine, reduce_range=False,
)  # fmt: skip


def weight_range(saturates: bool) -> tuple[int, int]:
    """The int8 weight range the host's kernels compute exactly: 7 bits where their int8 dot
    product saturates (255 · 64 · 2 fits int16; 255 · 128 · 2 does not), else 8 bits."""
    return (-64, 63) if saturates else (-128, 127)


def qconfig() -> QConfig:
    low, high = weight_range(cpu_info().int8_dot_saturates)
    weight = FakeQuantize.with_args(
        observer=MovingAveragePerChannelMinMaxObserver, quant_min=low, quant_max=high,
        dtype=torch.qint8, qscheme=torch.per_channel_symmetric, ch_axis=0, reduce_range=False,
    )  # fmt: skip
    return QConfig(activation=ACTIVATION, weight=weight)


# Fine-tuning: a fraction of the training recipe at a tenth of its learning rate.
QAT_EPOCHS, QAT_LR_FACTOR = 0.5, 0.1


def prepare(model: nn.Module, example: torch.Tensor) -> nn.Module:
    """A copy of `model` with BatchNorm folded and fake-quantizers on every Conv and Linear."""
    from torch.ao.quantization.quantize_fx import prepare_qat_fx

    folded = fuse(copy.deepcopy(model).eval())
    mapping, config = QConfigMapping(), qconfig()
    for kind in (nn.Conv2d, nn.Linear, nn.ReLU):  # ReLU: fused with its conv, same qconfig
        mapping.set_object_type(kind, config)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao's deprecation notice, once per call
            return prepare_qat_fx(folded.train(), mapping, (example,))
    except Exception as exc:  # fx raises many kinds for Python it cannot trace
        raise KilnError(
            f"{type(model).__name__}: torch.fx cannot trace it for quantization-aware training "
            f"({str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__})."
        ) from None


def qat(
    model: nn.Module,
    data: Dataset,
    recipe: Recipe,
    tick: Tick | None = None,
    deadline: float | None = None,
) -> nn.Module:
    """Fine-tune a quantization-aware copy of `model`; the frozen result (eval mode) computes
    exactly what its int8 QDQ export computes."""
    prepared = prepare(model, data.train.x[: recipe.batch])
    short = recipe.scaled(QAT_EPOCHS, lr=recipe.lr * QAT_LR_FACTOR)
    fit(prepared, data, short, tick=tick, deadline=deadline)
    return freeze(prepared)


def freeze(prepared: nn.Module) -> nn.Module:
    """Every FakeQuantize replaced by its frozen scales (observers off, export-friendly)."""
    prepared.apply(disable_observer)
    for module in list(prepared.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, FakeQuantize):
                setattr(module, name, FrozenFakeQuant(child))
    return prepared.eval()


class FrozenFakeQuant(nn.Module):
    """A FakeQuantize with its learnt scale and zero point as constants: the exporter turns it
    into QuantizeLinear → DequantizeLinear (FakeQuantize's own forward branches on buffers,
    which torch.export refuses as data-dependent).

    ONNX's QuantizeLinear only knows the full int8/uint8 ranges, so a narrower trained range
    (7-bit weights) is kept by clamping to it first; on a constant weight the clamp folds away
    and the int8 values stay within the trained range."""

    def __init__(self, source: FakeQuantize) -> None:
        super().__init__()
        self.per_channel = bool(source.is_per_channel)
        self.axis = int(source.ch_axis)
        scale = source.scale.detach().clone().float()
        zero_point = source.zero_point.detach().clone().int()
        self.register_buffer("scale", scale)
        self.register_buffer("zero_point", zero_point)
        self.scalar_scale = float(scale.flatten()[0])
        self.scalar_zero_point = int(zero_point.flatten()[0])
        low, high = int(source.quant_min), int(source.quant_max)
        self.quant_min, self.quant_max = (0, 255) if low >= 0 else (-128, 127)
        self.narrow = (low, high) != (self.quant_min, self.quant_max)
        self.register_buffer("low", (low - zero_point) * scale)
        self.register_buffer("high", (high - zero_point) * scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.narrow:
            shape = [-1 if d == self.axis else 1 for d in range(x.dim())]
            x = torch.clamp(x, self.low.reshape(shape), self.high.reshape(shape))
        if self.per_channel:
            return torch.fake_quantize_per_channel_affine(
                x, self.scale, self.zero_point, self.axis, self.quant_min, self.quant_max
            )
        return torch.fake_quantize_per_tensor_affine(
            x, self.scalar_scale, self.scalar_zero_point, self.quant_min, self.quant_max
        )
