"""The engines `kiln bench` can put side by side, each a zero-argument run function."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from kiln.backends import get_backend
from kiln.backends.ort import OrtOptions
from kiln.errors import KilnError

ENGINES = {
    "ort": "ONNX Runtime, ORT_ENABLE_ALL, fp32 (its default)",
    "ort-basic": "ONNX Runtime, ORT_ENABLE_BASIC, fp32",
    "openvino": "OpenVINO CPU, LATENCY hint, fp32 forced (INFERENCE_PRECISION_HINT=f32)",
    "openvino-bf16": "OpenVINO CPU, LATENCY hint, bf16 (its own default on CPUs with bf16)",
    "ort-transformers": "onnxruntime.transformers.optimizer (opt_level 0), then ORT_ENABLE_ALL",
    "ort-int8": "onnxruntime.quantization defaults (per-tensor weights): dynamic int8 for "
    "MatMul-heavy models, static QDQ MinMax on --calib or 8 synthetic samples for Conv-heavy ones",
    "openvino-int8": "NNCF quantize defaults (TRANSFORMER type for MatMul-heavy models) on --calib "
    "or 8 synthetic samples, then OpenVINO CPU with its own default precision elsewhere",
}
CALIBRATION_SAMPLES = 8


def parse_engines(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    for name in names:
        if name not in ENGINES:
            raise KilnError(
                f"unknown engine '{name}' in --against; choose from {', '.join(ENGINES)}."
            )
    return names


def engine_runner(
    name: str,
    original: ir.Model,
    feeds: dict[str, np.ndarray],
    calibration: list[dict[str, np.ndarray]] | None = None,
) -> Callable[[], object]:
    """Compile the original model for a baseline engine and return a run-once function."""
    ort = get_backend("ort")
    if name == "ort":
        exe = ort.compile(original, OrtOptions(optimization="all"))
    elif name == "ort-basic":
        exe = ort.compile(original, OrtOptions(optimization="basic"))
    elif name == "ort-transformers":
        from kiln.backends.ort_transformers import transformers_optimize

        proto = transformers_optimize(original)
        exe = ort.compile(ir.serde.deserialize_model(proto), OrtOptions(optimization="all"))
    elif name in ("openvino", "openvino-bf16"):
        from kiln.backends.openvino import OpenVinoOptions

        wanted = "bf16" if name == "openvino-bf16" else "f32"
        options = OpenVinoOptions(inference_precision=wanted)
        exe = get_backend("openvino").compile(original, options)
        # OpenVINO may quietly run another precision than asked: name the engine honestly.
        if exe.precision != wanted:
            raise KilnError(
                f"engine '{name}': OpenVINO runs {exe.precision} here, not {wanted} "
                "(no bf16 support on this CPU?)."
            )
    elif name in ("ort-int8", "openvino-int8"):
        exe = _int8_by_hand(name, original, calibration)
    else:
        raise KilnError(f"unknown engine '{name}'.")
    return lambda: exe.run(feeds)


def _int8_by_hand(name: str, original: ir.Model, samples: list | None = None):
    """What a user gets from the engine's own int8 tools with their defaults, nothing Kiln."""
    from kiln.backends.openvino import OpenVinoOptions
    from kiln.backends.openvino_quant import quantize_nncf_int8
    from kiln.backends.ort_quant import quantize_dynamic_int8, quantize_static_int8
    from kiln.ir.inputs import default_dims, synthesize
    from kiln.precision import conv_heavy

    conv = conv_heavy(original)
    dims = default_dims(original)
    if samples is None:
        samples = [synthesize(original, dims, seed=100 + i) for i in range(CALIBRATION_SAMPLES)]
    if name == "openvino-int8":
        model = quantize_nncf_int8(original, samples, transformer=not conv)
        return get_backend("openvino").compile(model, OpenVinoOptions())
    # ONNX Runtime's defaults quantize weights per tensor.
    model = (
        quantize_static_int8(original, samples, per_channel=False)
        if conv
        else quantize_dynamic_int8(original, per_channel=False)
    )
    return get_backend("ort").compile(model, OrtOptions(optimization="all"))
