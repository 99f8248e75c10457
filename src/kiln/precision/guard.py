"""The accuracy guard: quantize every layer, and if the budget breaks, find the layers that
break it by measurement and keep exactly those out of the lower precision.

Guarantee: the returned model meets the budget (as judged by the `meets_budget` the caller
gives) or its plan quantizes nothing; every node the quantizer made carries `kiln.origin` (the
original nodes it stands for) and `kiln.pass` = the quantization step (`quantize-int8`, ...).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import onnx_ir as ir

from kiln.ir.provenance import stamp_rewritten


def pass_name(precision: str) -> str:
    """The provenance name of the quantization step for `precision`."""
    return f"quantize-{precision}"


@dataclass
class PrecisionPlan:
    """Which layers run quantized and which were kept in fp32, and why."""

    int8: list[str] = field(default_factory=list)  # the quantized layers (int8 or int4)
    fp32: dict[str, str] = field(default_factory=dict)  # node → reason
    sensitivity: dict[str, float] = field(default_factory=dict)
    precision: str = "int8"
    restored_to: str = "fp32"  # what a restored layer runs in (bf16 where the engine says so)

    def to_json(self) -> dict:
        nodes = dict.fromkeys(self.int8, self.precision)
        nodes.update({name: f"{self.restored_to} ({why})" for name, why in self.fp32.items()})
        return {"default": self.precision, "nodes": nodes}


def quantize_guarded(
    model: ir.Model,
    sensitivity: dict[str, float],
    meets_budget: Callable[[ir.Model], tuple[bool, float]],
    quantize: Callable[[ir.Model, list[str]], ir.Model],
    precision: str = "int8",
    say: Callable[[str], None] = lambda _m: None,
    every_layer: tuple[ir.Model, bool, float] | None = None,
) -> tuple[ir.Model, PrecisionPlan, float]:
    """Quantize all; if the budget fails, find the layers that break it by measurement and
    keep those in fp32. Layers are taken least sensitive first (by the cheap estimate); the
    shortest prefix that fails together with the layers already accepted ends in a culprit,
    found by bisection (each culprit costs about log2(layers) quantizations). The estimate
    only orders the search: the budget itself decides who is restored. Past a bounded number
    of trials the layers not yet judged are kept in fp32. Returns the model, its plan and its
    metric; the plan quantizes nothing when no layer can stay quantized. `every_layer`: the
    caller's own judged quantize-all (model, ok, metric), so it is not quantized again."""
    order = sorted(sensitivity, key=sensitivity.get)
    trials = 0

    def trial(quantized: list[str]) -> tuple[ir.Model, bool, float]:
        nonlocal trials
        trials += 1
        chosen = set(quantized)
        kept = [n for n in order if n not in chosen]
        candidate = quantize(model, kept)
        stamp_rewritten(model, candidate, pass_name(precision))
        ok, metric = meets_budget(candidate)
        say(f"{precision} with {len(kept)} layers kept in fp32: metric {metric:.4f}")
        return candidate, ok, metric

    limit = 8 + 4 * max(1, len(order)).bit_length()
    accepted: list[str] = []
    restored: dict[str, str] = {}
    rest = list(order)
    best = every_layer if every_layer is not None else trial(rest)
    while rest and not best[1]:
        if trials >= limit:
            restored |= dict.fromkeys(rest, "restored: not judged within the search's bound")
            best, rest = trial(accepted), []
            break
        low, high = 0, len(rest)  # accepted+rest[:low] meets the budget; +rest[:high] fails
        while high - low > 1:
            middle = (low + high) // 2
            _, ok, _ = trial(accepted + rest[:middle])
            low, high = (middle, high) if ok else (low, middle)
        culprit = rest[high - 1]
        restored[culprit] = (
            f"restored: breaks the budget when quantized (estimated error "
            f"{sensitivity[culprit]:.2%})"
        )
        accepted += rest[: high - 1]
        rest = rest[high:]
        best = trial(accepted + rest)
        if best[1]:
            accepted += rest
    candidate, _ok, metric = best
    plan = PrecisionPlan(
        int8=[n for n in order if n not in restored],
        fp32=restored,
        sensitivity=sensitivity,
        precision=precision,
    )
    return candidate, plan, metric
