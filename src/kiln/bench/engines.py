"""The engines `kiln bench` can put side by side, each a zero-argument run function."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

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
    original: ir.Model | str,
    feeds: dict[str, np.ndarray],
    calibration: list[dict[str, np.ndarray]] | None = None,
) -> Callable[[], object]:
    """Compile the original model for a baseline engine and return a run-once function."""
    exe = engine_compile(name, engine_model(name, original, calibration))
    return lambda: exe.run(feeds)


def engine_model(
    name: str,
    original: ir.Model | str,
    calibration: list[dict[str, np.ndarray]] | None = None,
) -> ir.Model | str:
    """The model `name` runs: the original (a model or its file), or what the engine's own
    tool rewrote it into (its transformer optimizer, its int8 quantizer)."""
    if name not in ENGINES:
        raise KilnError(f"unknown engine '{name}'.")
    if name == "ort-transformers":
        from kiln.backends.ort_transformers import transformers_optimize

        return ir.serde.deserialize_model(transformers_optimize(_as_model(original)))
    if name in ("ort-int8", "openvino-int8"):
        return _int8_by_hand(name, _as_model(original), calibration)
    return original


def engine_compile(name: str, model: ir.Model | str) -> Any:
    """`model` (what engine_model gave) compiled with the engine's settings: an Executable."""
    if name.startswith("openvino"):
        from kiln.backends.openvino import OpenVinoOptions

        # The peers are OpenVINO as a user runs it: the mapped weights and the library pages
        # its compile read stay resident.
        as_is = {"release_mapped": False, "release_code": False}
        if name == "openvino-int8":  # its own default precision elsewhere
            return get_backend("openvino").compile(model, OpenVinoOptions(**as_is))
        wanted = "bf16" if name == "openvino-bf16" else "f32"
        options = OpenVinoOptions(inference_precision=wanted, **as_is)
        exe = get_backend("openvino").compile(model, options)
        # OpenVINO may quietly run another precision than asked: name the engine honestly.
        if exe.precision != wanted:
            raise KilnError(
                f"engine '{name}': OpenVINO runs {exe.precision} here, not {wanted} "
                "(no bf16 support on this CPU?)."
            )
        return exe
    level = "basic" if name == "ort-basic" else "all"
    # As-is: ONNX Runtime's own spinning, not the stop Kiln's sessions choose.
    return get_backend("ort").compile(model, OrtOptions(optimization=level, stop_spinning=False))


def _as_model(model: ir.Model | str) -> ir.Model:
    return ir.load(model) if isinstance(model, str) else model


def _int8_by_hand(name: str, original: ir.Model, samples: list | None = None) -> ir.Model:
    """What a user gets from the engine's own int8 tools with their defaults, nothing Kiln."""
    from kiln.backends.openvino_quant import quantize_nncf_int8
    from kiln.backends.ort_quant import quantize_dynamic_int8, quantize_static_int8
    from kiln.ir.inputs import default_dims, synthesize
    from kiln.precision import conv_heavy

    conv = conv_heavy(original)
    dims = default_dims(original)
    if samples is None:
        samples = [synthesize(original, dims, seed=100 + i) for i in range(CALIBRATION_SAMPLES)]
    if name == "openvino-int8":
        return quantize_nncf_int8(original, samples, transformer=not conv)
    # ONNX Runtime's defaults quantize weights per tensor.
    if conv:
        return quantize_static_int8(original, samples, per_channel=False)
    return quantize_dynamic_int8(original, per_channel=False)
