"""Lower precision under an accuracy guard: int8 (ONNX Runtime dynamic/static, OpenVINO through
NNCF), int4 (MatMulNBits), bf16 plans, calibration, and the guard that keeps exactly the layers
that break the budget out of the lower precision. A stage of the compiler that never imports it.
"""

from kiln.errors import KilnError
from kiln.precision.bf16 import bf16_plan, bf16_refusal, no_bf16_kernels
from kiln.precision.calibration import Calibration, calibration_for
from kiln.precision.guard import PrecisionPlan, pass_name, quantize_guarded
from kiln.precision.quantizers import is_static
from kiln.precision.recipes import Recipe, hand_recipe, has_hand_recipe, resolve_recipe
from kiln.precision.sensitivity import conv_heavy
from kiln.precision.stage import Quantized, quantize_under_budget

# Which engine runs which precision here.
ENGINES_FOR = {
    "fp32": ("ort", "openvino"),
    "bf16": ("openvino",),
    "int8": ("ort", "openvino"),
    "int4": ("ort",),
}
QUANTIZED = ("int8", "int4")


def check_precision(engine: str, precision: str) -> None:
    if precision not in ENGINES_FOR:
        raise KilnError(f"unknown precision '{precision}'; use one of {', '.join(ENGINES_FOR)}.")
    if engine not in ENGINES_FOR[precision]:
        engines = ", ".join(ENGINES_FOR[precision])
        raise KilnError(
            f"precision {precision} runs on {engines} here, not {engine}; "
            f"use --backend {ENGINES_FOR[precision][0]} or --backend auto."
        )


__all__ = [
    "ENGINES_FOR",
    "QUANTIZED",
    "Calibration",
    "PrecisionPlan",
    "Quantized",
    "Recipe",
    "bf16_plan",
    "bf16_refusal",
    "no_bf16_kernels",
    "calibration_for",
    "check_precision",
    "conv_heavy",
    "hand_recipe",
    "has_hand_recipe",
    "is_static",
    "pass_name",
    "quantize_guarded",
    "quantize_under_budget",
    "resolve_recipe",
]
