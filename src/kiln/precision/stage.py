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

from kiln.ir.provenance import stamp_rewritten
from kiln.precision.calibration import Calibration
from kiln.precision.guard import pass_name, quantize_guarded
from kiln.precision.quantizers import Quantizer, quantizer_for
from kiln.precision.recipes import Recipe
from kiln.precision.sensitivity import activation_matmuls, quantizable
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
    recipe: Recipe | None = None,
    say: Callable[[str], None] = lambda _m: None,
) -> Quantized:
    """int8/int4 on `engine` with the most sensitive layers restored until `check` passes.
    An int8 that meets the budget only with every layer restored is refused, not labelled.
    A hand `recipe` is tried as its tool makes it first; the guard restores layers only when
    that breaks the budget, and the plan's "recipe" says so."""
    quantizer = quantizer_for(
        model, precision, engine, calibration.samples, feeds, method, block_size, recipe
    )
    checks: dict[int, Verification] = {}
    every_layer = None
    if recipe is not None and quantizable(model):
        as_is = _as_the_tool_makes_it(model, quantizer, recipe, calibration, check, say)
        verification = as_is.verification
        if verification is not None and verification.ok:
            return as_is
        checks[id(as_is.model)] = verification  # the guard starts from it
        every_layer = (as_is.model, False, verification.score or 0.0)
    say(f"measuring each layer's {precision} sensitivity")
    empty = {"default": precision, "nodes": {}, "scheme": quantizer.scheme}
    if not quantizer.sensitivity:
        error = f"the model has no layer {precision} quantizes ({quantizer.scheme})"
        return Quantized(model, empty, None, 0, error)  # no verification: nothing was tried

    def meets_budget(candidate: ir.Model) -> tuple[bool, float]:
        verification = check(candidate)
        checks[id(candidate)] = verification
        return verification.ok, verification.score if verification.score is not None else 0.0

    guarded, plan, _ = quantize_guarded(
        model, quantizer.sensitivity, meets_budget, quantizer.quantize, precision, say,
        every_layer,
    )  # fmt: skip
    plan.restored_to = restored_to
    verification = checks[id(guarded)]
    plan_json = {**plan.to_json(), "scheme": quantizer.scheme, "calibration": calibration.note}
    if recipe is not None:
        count = len(plan.fp32)
        kept = f"guard kept {count} layer{'s' * (count != 1)} in fp32: as is it broke the budget"
        plan_json["recipe"] = _recipe_json(recipe, kept)
    if not plan.int8:
        error = f"{precision} meets the accuracy budget only with every layer kept in fp32"
        return Quantized(guarded, plan_json, verification, 0, error)
    return Quantized(guarded, plan_json, verification, len(plan.int8))


def _as_the_tool_makes_it(
    model: ir.Model,
    quantizer: Quantizer,
    recipe: Recipe,
    calibration: Calibration,
    check: Check,
    say: Callable[[str], None],
) -> Quantized:
    """The recipe with nothing kept out, verified: what the user's own run would give."""
    say(f"quantizing by hand: {recipe.tool}")
    candidate = quantizer.quantize(model, [])
    stamp_rewritten(model, candidate, pass_name(recipe.precision))
    verification = check(candidate)
    if not verification.ok:
        say(f"{recipe.name} as is breaks the budget ({verification.summary()})")
    # The layers the tool may quantize (it decides itself which it does).
    layers = list(quantizable(model)) + (activation_matmuls(model) if recipe.static else [])
    plan = {
        "default": recipe.precision,
        "nodes": dict.fromkeys(layers, recipe.precision),
        "scheme": quantizer.scheme,
        "calibration": calibration.note,
        "recipe": _recipe_json(recipe, None),
    }
    return Quantized(candidate, plan, verification, len(layers))


def _recipe_json(recipe: Recipe, guard: str | None) -> dict[str, Any]:
    """The manifest's record of a hand recipe: which, what it runs, and what the guard did."""
    return {"name": recipe.name, "tool": recipe.tool, "graph": "original", "guard": guard}
