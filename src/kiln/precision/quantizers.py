"""Which quantizer, which sensitivity estimate and which scheme name, per engine and model.

int4: ONNX Runtime's MatMulNBits, block-wise weight error. int8 on OpenVINO: NNCF static QDQ.
int8 on ONNX Runtime: static QDQ (calibrated) for Conv-heavy models, dynamic for the rest.
A hand recipe (kiln.precision.recipes) quantizes with the engine's tool at its defaults instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from kiln.hardware import cpu_info
from kiln.passes.int8_rows import Int8RowsPass
from kiln.passes.key_transpose import KeyTransposeSplitPass
from kiln.precision.recipes import Recipe
from kiln.precision.sensitivity import (
    activation_matmuls,
    conv_heavy,
    layer_sensitivity,
    weight_sensitivity,
)

Quantize = Callable[[ir.Model, list[str]], ir.Model]


@dataclass
class Quantizer:
    """quantize(model, layers kept out) for one engine, and the cheap per-layer estimate that
    orders the guard's search (measured when first asked: a recipe that meets the budget
    as it is never needs it)."""

    scheme: str
    quantize: Quantize
    estimate: Callable[[], dict[str, float]]
    _sensitivity: dict[str, float] | None = field(default=None, repr=False)

    @property
    def sensitivity(self) -> dict[str, float]:
        if self._sensitivity is None:
            self._sensitivity = self.estimate()
        return self._sensitivity


def is_static(model: ir.Model, precision: str, engine: str) -> bool:
    """Static (calibrated) int8: every model on OpenVINO, Conv-heavy ones on ONNX Runtime."""
    return precision == "int8" and (engine == "openvino" or conv_heavy(model))


def quantizer_for(
    model: ir.Model,
    precision: str,
    engine: str,
    samples: list[dict[str, np.ndarray]] | None,
    feeds: dict[str, np.ndarray],
    method: str,
    block_size: int,
    recipe: Recipe | None = None,
) -> Quantizer:
    from kiln.backends.ort_quant import quantize_dynamic_int8, quantize_int4, quantize_static_int8

    if precision == "int4":
        return Quantizer(
            f"4-bit weights (MatMulNBits, block {block_size})",
            lambda m, kept: quantize_int4(m, kept, block_size),
            lambda: weight_sensitivity(model, bits=4, block=block_size, ops=("MatMul",)),
        )
    conv = conv_heavy(model)

    def estimate() -> dict[str, float]:
        sensitivity = weight_sensitivity(model) if conv else layer_sensitivity(model, feeds)
        if samples is not None:  # static: activation×activation MatMuls are quantized as well
            sensitivity |= dict.fromkeys(activation_matmuls(model), 0.0)
        return sensitivity

    if recipe is not None:
        return Quantizer(f"hand recipe: {recipe.tool}", _by_hand(recipe, samples), estimate)
    if engine == "openvino":
        return Quantizer("static QDQ (NNCF)", _nncf(samples, transformer=not conv), estimate)
    # 7-bit weights where the host's int8 kernels would saturate on full-range ones.
    narrow = cpu_info().int8_dot_saturates
    if samples is not None:
        return Quantizer(
            f"static QDQ ({method}{', 7-bit weights' if narrow else ''})",
            lambda m, kept: quantize_static_int8(m, samples, kept, method, reduce_range=narrow),
            estimate,
        )
    return Quantizer(
        f"dynamic{' (7-bit weights)' if narrow else ''}",
        lambda m, kept: quantize_dynamic_int8(m, kept, reduce_range=narrow),
        estimate,
    )


def _by_hand(recipe: Recipe, samples: list[dict[str, np.ndarray]] | None) -> Quantize:
    """The engine's tool at its defaults (as `kiln bench`'s hand-run peers call it): ORT's
    quantizers with per-tensor weights at full range, NNCF with its preset for the model."""
    from kiln.backends.ort_quant import quantize_dynamic_int8, quantize_static_int8

    if recipe.name.startswith("nncf-"):
        return _nncf(samples, transformer=recipe.name == "nncf-transformer")
    if recipe.name == "ort-static":
        return lambda m, kept: quantize_static_int8(m, samples or [], kept, per_channel=False)
    return lambda m, kept: quantize_dynamic_int8(m, kept, per_channel=False)


def _nncf(samples: list[dict[str, np.ndarray]] | None, transformer: bool) -> Quantize:
    """NNCF's static int8, its embedding tables then read as int8 (`Int8RowsPass`: OpenVINO
    would hold them as fp32) and attention's K^T written so that OpenVINO fuses it
    (`KeyTransposeSplitPass`); bit-identical outputs, so a recipe's point is still its own."""
    from kiln.backends.openvino_quant import quantize_nncf_int8

    def quantize(model: ir.Model, kept: list[str]) -> ir.Model:
        quantized = quantize_nncf_int8(model, samples or [], kept, transformer=transformer)
        return KeyTransposeSplitPass()(Int8RowsPass()(quantized).model).model

    return quantize
