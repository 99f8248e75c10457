"""ONNX Runtime's dynamic int8 quantization, as a backend-specific transformation.

Weights become int8 (per output channel); activations are quantized to uint8 at run time
(DynamicQuantizeLinear), so no calibration data is needed. MatMul, Gemm and com.microsoft
Attention are quantized (MatMulInteger / QAttention) unless excluded by node name.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Sequence
from pathlib import Path

import onnx
import onnx_ir as ir

from kiln.errors import KilnError

QUANTIZED_OPS = ["MatMul", "Gemm", "Attention"]


def quantize_dynamic_int8(model: ir.Model, exclude: Sequence[str] = ()) -> ir.Model:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    logging.disable(logging.WARNING)  # it advises pre-processing on the root logger, every call
    try:
        return _quantize(model, exclude, quantize_dynamic, QuantType)
    finally:
        logging.disable(logging.NOTSET)


def _quantize(model: ir.Model, exclude: Sequence[str], quantize_dynamic, QuantType) -> ir.Model:  # noqa: N803
    with tempfile.TemporaryDirectory(prefix="kiln-int8-") as tmp:
        source, target = Path(tmp) / "fp32.onnx", Path(tmp) / "int8.onnx"
        ir.save(model, source, external_data="fp32.onnx.data")
        try:
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
        except Exception as exc:  # the quantizer raises bare errors on graphs it cannot read
            raise KilnError(f"ONNX Runtime's int8 quantizer failed: {exc}") from None
        quantized = ir.load(target)
        return ir.external_data.load_to_model(quantized)


def quantize_static_int8(
    model: ir.Model, calibration: Sequence[dict], exclude: Sequence[str] = ()
) -> ir.Model:
    """Static int8 in QDQ form: per-channel int8 weights, uint8 activations with ranges
    calibrated (MinMax) on `calibration`; ONNX Runtime fuses the QDQ pairs into int8 kernels."""
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

    logging.disable(logging.WARNING)
    try:
        with tempfile.TemporaryDirectory(prefix="kiln-qdq-") as tmp:
            source, target = Path(tmp) / "fp32.onnx", Path(tmp) / "int8.onnx"
            ir.save(model, source, external_data="fp32.onnx.data")
            try:
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
            except Exception as exc:  # the quantizer raises bare errors on graphs it cannot read
                raise KilnError(f"ONNX Runtime's static int8 quantizer failed: {exc}") from None
            return ir.external_data.load_to_model(ir.load(target))
    finally:
        logging.disable(logging.NOTSET)
