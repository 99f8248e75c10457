"""ONNX Runtime's int8 quantizers, as backend-specific transformations.

Dynamic: weights int8 per output channel, activations quantized to uint8 at run time
(DynamicQuantizeLinear), no calibration; MatMul, Gemm and com.microsoft Attention become
MatMulInteger / QAttention. Static: QDQ form with activation ranges calibrated on samples;
ONNX Runtime fuses the QDQ pairs into int8 kernels. Both skip nodes excluded by name.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import onnx
import onnx_ir as ir

from kiln.errors import KilnError

QUANTIZED_OPS = ["MatMul", "Gemm", "Attention"]


def _through_files(model: ir.Model, kind: str, quantize: Callable[[Path, Path], None]) -> ir.Model:
    """The quantizers read and write files: save, quantize, load back into memory."""
    logging.disable(logging.WARNING)  # they advise pre-processing on the root logger, every call
    try:
        with tempfile.TemporaryDirectory(prefix="kiln-int8-") as tmp:
            source, target = Path(tmp) / "fp32.onnx", Path(tmp) / "int8.onnx"
            ir.save(model, source, external_data="fp32.onnx.data")
            try:
                quantize(source, target)
            except Exception as exc:  # the quantizers raise bare errors on graphs they can't read
                raise KilnError(f"ONNX Runtime's {kind} int8 quantizer failed: {exc}") from None
            return ir.external_data.load_to_model(ir.load(target))
    finally:
        logging.disable(logging.NOTSET)


def quantize_dynamic_int8(model: ir.Model, exclude: Sequence[str] = ()) -> ir.Model:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    def quantize(source: Path, target: Path) -> None:
        quantize_dynamic(
            source,
            target,
            op_types_to_quantize=QUANTIZED_OPS,
            per_channel=True,
            weight_type=QuantType.QInt8,
            nodes_to_exclude=list(exclude),
            use_external_data_format=True,
            # Shape inference cannot type com.microsoft outputs; ENGINE-NOTES #4.
            extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
        )

    return _through_files(model, "dynamic", quantize)


def quantize_static_int8(
    model: ir.Model, calibration: Sequence[dict], exclude: Sequence[str] = ()
) -> ir.Model:
    """Static int8 in QDQ form: per-channel int8 weights, uint8 activations with ranges
    calibrated (MinMax) on `calibration`."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.feeds = iter(calibration)

        def get_next(self) -> dict | None:
            return next(self.feeds, None)

    def quantize(source: Path, target: Path) -> None:
        quantize_static(
            source,
            target,
            Reader(),
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            calibrate_method=CalibrationMethod.MinMax,
            nodes_to_exclude=list(exclude),
            use_external_data_format=True,
        )

    return _through_files(model, "static", quantize)
