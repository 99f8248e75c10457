"""Two rules that write a Linear as MatMul + Add. A Linear exported as Reshape → Gemm → Reshape
(GPT-2's Conv1D, `addmm` in both PyTorch exporters) becomes MatMul + Add on the 3-D
activations, the form every transformer fusion (SkipLayerNormalization's bias, BiasGelu,
attention projections) is written against. And before int4, any Gemm with a constant weight
becomes MatMul + Add (`GemmToMatMulPass`): ONNX Runtime's 4-bit quantizer packs MatMul
weights only.

Same style as `onnxscript.rewriter.ort_fusions`: a pattern, a check that says why, a rewrite.
"""

from __future__ import annotations

import onnx_ir as ir
import onnx_ir.passes.common as common
from onnxscript.rewriter import pattern

from kiln.ir.onnxscript_internals import get_numpy_value
from kiln.passes.base import KilnPass


class GemmAsMatMul(pattern.RewriteRuleClassBase):
    """Reshape(x[B, S, K] → [-1, K]) · Gemm(W, c) · Reshape(→ [B, S, N]) = x·W + c."""

    def pattern(self, op, x, flat_shape, w, out_shape):
        flat = op.Reshape(x, flat_shape, _allow_other_attributes=True)
        gemm = op.Gemm(
            flat, w, pattern.Var("c", can_match_none=True),
            _allow_other_attributes=True, _outputs=["product"],
        )  # fmt: skip
        return op.Reshape(gemm, out_shape, _allow_other_attributes=True, _outputs=["out"])

    def check(self, context, x, w, product, out, c=None, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        gemm = product.producer()
        attributes = gemm.attributes
        if attributes.get_int("transA", 0) or attributes.get_float("alpha", 1.0) != 1.0:
            return result.fail("Gemm transposes or scales its input", gemm)
        if c is not None and attributes.get_float("beta", 1.0) != 1.0:
            return result.fail("Gemm scales its bias", gemm)
        weight = get_numpy_value(w)
        if weight is None or weight.ndim != 2:
            return result.fail("Gemm weight is not a constant matrix", w)
        n = weight.shape[0 if attributes.get_int("transB", 0) else 1]
        bias = get_numpy_value(c) if c is not None else None
        if c is not None and (bias is None or bias.size not in (1, n)):
            return result.fail("Gemm bias is not a constant vector", c)
        if x.shape is None or out.shape is None or x.shape.rank() != 3 or out.shape.rank() != 3:
            return result.fail("the Linear's input or output is not 3-D", x)
        if list(out.shape)[:2] != list(x.shape)[:2] or out.shape[2] != n:
            return result.fail(f"output {out.shape} is not input {x.shape} with {n} features", out)
        return result

    def rewrite(self, op, x, w, product, c=None, **_):
        y = op.MatMul(x, _matmul_weight(op, w, product))
        if c is None:
            return y
        bias = get_numpy_value(c).reshape(-1)
        return op.Add(y, op.initializer(ir.tensor(bias), name=f"{c.name}.vector"))


def _matmul_weight(op, w, product):
    """The Gemm's constant weight as MatMul takes it: stored transposed where Gemm's transB
    read it transposed."""
    if not product.producer().attributes.get_int("transB", 0):
        return w
    return op.initializer(ir.tensor(get_numpy_value(w).T.copy()), name=f"{w.name}.transposed")


gemm_as_matmul_rules = pattern.RewriteRuleSet([GemmAsMatMul.rule()])


class GemmToMatMulAdd(pattern.RewriteRuleClassBase):
    """Gemm(a, W, c) with W constant = a·W (Wᵀ stored when transB) + c."""

    def pattern(self, op, a, w):
        return op.Gemm(
            a, w, pattern.Var("c", can_match_none=True),
            _allow_other_attributes=True, _outputs=["product"],
        )  # fmt: skip

    def check(self, context, w, product, c=None, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        attributes = product.producer().attributes
        if attributes.get_int("transA", 0) or attributes.get_float("alpha", 1.0) != 1.0:
            return result.fail("Gemm transposes or scales its input", product.producer())
        if c is not None and attributes.get_float("beta", 1.0) != 1.0:
            return result.fail("Gemm scales its bias", product.producer())
        weight = get_numpy_value(w)
        if weight is None or weight.ndim != 2:
            return result.fail("Gemm weight is not a constant matrix", w)
        return result

    def rewrite(self, op, a, w, product, c=None, **_):
        y = op.MatMul(a, _matmul_weight(op, w, product))
        # Gemm broadcasts c to its [M, N] output one way; Add gives the same [M, N].
        return y if c is None else op.Add(y, c)


class GemmToMatMulPass(KilnPass):
    """Every Gemm with a constant weight matrix (transposed or not, bias or not, unscaled)
    becomes MatMul + Add computing the same values, so that int4 finds its weight."""

    name = "gemm-to-matmul"
    stage = "precision"
    summary = "A Gemm with a constant weight becomes MatMul + Add, the layer int4 quantizes."

    def apply(self, model: ir.Model) -> int:
        count = pattern.RewriteRuleSet([GemmToMatMulAdd.rule()]).apply_to_model(model)
        common.RemoveUnusedNodesPass()(model)  # the untransposed weight it leaves behind
        return count
