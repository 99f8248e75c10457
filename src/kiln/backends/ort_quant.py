"""ONNX Runtime's int8 quantizers, as backend-specific transformations.

Dynamic: weights int8 per output channel, activations quantized to uint8 at run time
(DynamicQuantizeLinear), no calibration; MatMul, Gemm and com.microsoft Attention become
MatMulInteger / QAttention. Static: QDQ form with activation ranges calibrated on samples;
ONNX Runtime fuses the QDQ pairs into int8 kernels. 4-bit: MatMul weights packed into
com.microsoft MatMulNBits, block-wise, activations quantized to int8 inside the kernel. All skip
nodes excluded by name.
"""

from __future__ import annotations

import contextlib
import io
import logging
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import onnx
import onnx_ir as ir

from kiln.errors import KilnError

QUANTIZED_OPS = ["MatMul", "Gemm", "Attention"]
# Static QDQ quantizes only the layers the guard can judge and restore; ONNX Runtime's default
# would also quantize every Add, Mul, Concat, pooling... with no one answering for them.
STATIC_OPS: list[str] | None = ["Conv", "MatMul", "Gemm"]


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
            # onnx.load also reads external tensors held in Constant attributes, which
            # ir's load_to_model leaves pointing into the temporary directory.
            return ir.serde.deserialize_model(onnx.load(str(target)))
    finally:
        logging.disable(logging.NOTSET)


def _at_least_opset(model: ir.Model, version: int) -> ir.Model:
    """A copy converted up to `version` when the model is older (per-channel QDQ needs the
    `axis` attribute of opset 13's QuantizeLinear); the model itself is left as it is."""
    if model.opset_imports.get("", version) >= version:
        return model
    from onnx import version_converter  # onnxscript's converts only to opset 18 and up

    return ir.serde.deserialize_model(
        version_converter.convert_version(ir.serde.serialize_model(model), version)
    )


def _excluded(exclude: Sequence[str]) -> list[str]:
    """ONNX Runtime's quantizers (1.32) first rewrite a Gemm into MatMul + Add named
    `<gemm>_MatMul` and then quantize that MatMul whatever `nodes_to_exclude` says about the
    Gemm: exclude both names."""
    return [*exclude, *(f"{name}_MatMul" for name in exclude)]


def quantize_dynamic_int8(
    model: ir.Model,
    exclude: Sequence[str] = (),
    per_channel: bool = True,
    reduce_range: bool = False,
) -> ir.Model:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    def quantize(source: Path, target: Path) -> None:
        quantize_dynamic(
            source,
            target,
            op_types_to_quantize=QUANTIZED_OPS,
            per_channel=per_channel,
            reduce_range=reduce_range,
            weight_type=QuantType.QInt8,
            nodes_to_exclude=_excluded(exclude),
            use_external_data_format=True,
            # Shape inference cannot type com.microsoft outputs (docs/contributing/engine-notes.md).
            extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT},
        )

    return _through_files(model, "dynamic", quantize)


def quantize_static_int8(
    model: ir.Model,
    calibration: Sequence[dict],
    exclude: Sequence[str] = (),
    method: str = "minmax",
    per_channel: bool = True,
    reduce_range: bool = False,
) -> ir.Model:
    """Static int8 in QDQ form: per-channel int8 weights (7-bit with `reduce_range`), uint8
    activations with ranges calibrated on `calibration` by `method` (minmax, entropy or
    percentile)."""
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
        # The entropy and percentile calibrators print their progress to stdout, which is the
        # user's (`--json` output goes there).
        with contextlib.redirect_stdout(io.StringIO()):
            _quantize_static(source, target)

    def _quantize_static(source: Path, target: Path) -> None:
        quantize_static(
            source,
            target,
            Reader(),
            quant_format=QuantFormat.QDQ,
            op_types_to_quantize=STATIC_OPS,
            per_channel=per_channel,
            reduce_range=reduce_range,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            calibrate_method={
                "minmax": CalibrationMethod.MinMax,
                "entropy": CalibrationMethod.Entropy,
                "percentile": CalibrationMethod.Percentile,
            }[method],
            nodes_to_exclude=_excluded(exclude),
            use_external_data_format=True,
        )

    return _through_files(_at_least_opset(model, 13), "static", quantize)


def quantize_int4(model: ir.Model, exclude: Sequence[str] = (), block_size: int = 32) -> ir.Model:
    """4-bit weight-only MatMulNBits, symmetric blocks of `block_size` along the input dim;
    accuracy level 4 lets the kernel compute with int8 activations (VNNI)."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    def quantize(source: Path, target: Path) -> None:
        quantizer = MatMulNBitsQuantizer(
            onnx.load(str(source)),
            block_size=block_size,
            is_symmetric=True,
            accuracy_level=4,
            nodes_to_exclude=_excluded(exclude),
        )
        quantizer.process()
        quantizer.model.save_model_to_file(str(target), use_external_data_format=True)

    return _through_files(model, "4-bit", quantize)
