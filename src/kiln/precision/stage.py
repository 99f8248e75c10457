"""The precision stage of a compile: quantize under the accuracy budget.

The compiler hands the stage a `check` that compiles a candidate on the target engine and
verifies it against the fp32 reference; the stage never imports the compiler.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir

from kiln.precision.calibration import Calibration
from kiln.precision.guard import quantize_guarded
from kiln.precision.quantizers import quantizer_for
from kiln.verify import Verification

Check = Callable[[ir.Model], Verification]


@dataclass
class Quantized:
    """The stage's answer: the guarded model, the manifest's precision plan, the verification
    of exactly that model, how many layers were quantized, or why nothing could be."""

    model: ir.Model
    plan: dict[str, Any]
    verification: Verification | None
    quantized: int
    error: str | None = None


def quantize_under_budget(
    model: ir.Model,
    precision: str,
    engine: str,
    *,
    calibration: Calibration,
    feeds: dict[str, np.ndarray],
    method: str,
    block_size: int,
    check: Check,
    restored_to: str = "fp32",
    say: Callable[[str], None] = lambda _m: None,
) -> Quantized:
    """int8/int4 on `engine` with the most sensitive layers restored until `check` passes.
    An int8 that meets the budget only with every layer restored is refused, not labelled."""
    say(f"measuring each layer's {precision} sensitivity")
    quantizer = quantizer_for(
        model, precision, engine, calibration.samples, feeds, method, block_size
    )
    empty = {"default": precision, "nodes": {}, "scheme": quantizer.scheme}
    if not quantizer.sensitivity:
        error = f"the model has no layer {precision} quantizes ({quantizer.scheme})"
        return Quantized(model, empty, None, 0, error)  # no verification: nothing was tried
    checks: dict[int, Verification] = {}

    def meets_budget(candidate: ir.Model) -> tuple[bool, float]:
        verification = check(candidate)
        checks[id(candidate)] = verification
        return verification.ok, verification.score if verification.score is not None else 0.0

    guarded, plan, _ = quantize_guarded(
        model, quantizer.sensitivity, meets_budget, quantizer.quantize, precision, say
    )
    plan.restored_to = restored_to
    verification = checks[id(guarded)]
    plan_json = {**plan.to_json(), "scheme": quantizer.scheme, "calibration": calibration.note}
    if not plan.int8:
        error = f"{precision} meets the accuracy budget only with every layer kept in fp32"
        return Quantized(guarded, plan_json, verification, 0, error)
    return Quantized(guarded, plan_json, verification, len(plan.int8))
