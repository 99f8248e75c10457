"""A rule: the tanh GELU as PyTorch exports it (HF `NewGELUActivation`, GPT-2's `gelu_new`),
0.5·x · (1 + tanh(√(2/π)·(x + 0.044715·x³))), becomes com.microsoft FastGelu.

onnxscript's `ort_fusions.gelu` matches x · (0.5 · (1 + tanh(…))); both exporters multiply
0.5·x first, which no commuting of operands reaches. Constants are compared within float32
rounding (the exporters write 0.044714998…).
"""

from __future__ import annotations

import math

import numpy as np
from onnxscript.rewriter import pattern

from kiln.ir.onnxscript_internals import get_numpy_value

CONSTANTS = {"half": 0.5, "three": 3.0, "cubic": 0.044715, "slope": math.sqrt(2 / math.pi),
             "one": 1.0}  # fmt: skip


class TanhGelu(pattern.RewriteRuleClassBase):
    def pattern(self, op, x, half, three, cubic, slope, one):
        inner = op.Mul(op.Add(x, op.Mul(op.Pow(x, three), cubic)), slope)
        return op.Mul(op.Mul(x, half), op.Add(op.Tanh(inner), one))

    def check(self, context, x, **constants) -> pattern.MatchResult:
        result = pattern.MatchResult()
        for name, want in CONSTANTS.items():
            value = get_numpy_value(constants[name])
            if value is None or value.size != 1:
                return result.fail(f"the GELU's {name} factor is not a constant", constants[name])
            if not np.isclose(float(value.reshape(())), want, rtol=1e-6):
                return result.fail(f"the GELU's {name} factor is {value.item()}, not {want}")
        return result

    def rewrite(self, op, x, **_):
        return op.FastGelu(x, _domain="com.microsoft")


# commute: operand order differs between exporters and versions.
tanh_gelu_rules = pattern.RewriteRuleSet([TanhGelu.rule()], commute=True)
