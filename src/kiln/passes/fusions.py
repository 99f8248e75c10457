"""Fusion passes built from onnxscript rewrite rules: each entry is data, a name and a guarantee.

Where onnxscript's `ort_fusions` have the rule we use it; Kiln's own rules live in
`kiln.passes.rewrite_rules` in the same rule style.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import onnx_ir as ir
import onnx_ir.passes.common as common
from onnxscript.rewriter import pattern
from onnxscript.rewriter.ort_fusions import (
    attention,
    bias_gelu,
    erfgelu,
    fused_matmul_rule_sets,
    gelu,
    mha,
    mha_bias,
    sdpa,
    skip_normalization,
    softmax,
)

from kiln.ir import onnxscript_internals as internals
from kiln.passes import rewrite_rules
from kiln.passes.base import KilnPass
from kiln.passes.fused_op_pays import skip_layernorm_slower
from kiln.passes.gemm_as_matmul import gemm_as_matmul_rules
from kiln.passes.probed_attention import probed_attention_rules
from kiln.passes.refine_shapes import RefineShapesPass
from kiln.passes.shape_reads import ShapeReadsPass
from kiln.passes.tanh_gelu import tanh_gelu_rules

RuleSource = Callable[[], list[pattern.RewriteRule]]
# A fused block states shapes its exported form lost, which can free the next block (the
# next layer): rules that need shapes run again while they rewrite, up to this many times.
MAX_ROUNDS = 64


@dataclass(frozen=True)
class FusionSpec:
    name: str
    guarantee: str
    rules: RuleSource
    infer_shapes: bool = False  # some rules need shapes of the values they match
    # Standard ONNX out: any engine runs it. Otherwise the one engine whose ops it emits.
    portable: bool = False
    # Asked before the rules run: None when the fused op is worth it here, else why not (the
    # pass then leaves the model as it is and says so). For fused ops slower than their parts.
    declines: Callable[[ir.Model], str | None] | None = None


def _rules(*sets: pattern.RewriteRuleSet | list) -> RuleSource:
    def collect() -> list[pattern.RewriteRule]:
        out: list[pattern.RewriteRule] = []
        for item in sets:
            out.extend(item.rules if isinstance(item, pattern.RewriteRuleSet) else item)
        return out

    return collect


_EARLY: list[FusionSpec] = [
    FusionSpec(
        "fold-batchnorm",
        "BatchNormalization after Conv/ConvTranspose/Gemm folded into its weights; "
        "Pad folded into Conv pads.",
        _rules(internals.FUSE_BATCHNORM_RULES, internals.FUSE_PAD_INTO_CONV_RULES),
        portable=True,
    ),
    FusionSpec(
        "fuse-conv-activation",
        "Conv + Relu/Clip/Sigmoid/Tanh/LeakyRelu/HardSigmoid become com.microsoft FusedConv "
        "(Kiln rule).",
        _rules(rewrite_rules.conv_activation_rules),
    ),
    FusionSpec(
        "gemm-as-matmul",
        "A Linear exported as Reshape → Gemm → Reshape becomes MatMul + Add on the 3-D "
        "activations (Kiln rule).",
        _rules(gemm_as_matmul_rules),
        infer_shapes=True,
        portable=True,
    ),
    FusionSpec(
        "fuse-layernorm",
        "A LayerNorm written out (ReduceMean, Sub, Pow, Sqrt, Div, Mul, Add) becomes one "
        "LayerNormalization.",
        _rules(internals.LAYER_NORMALIZATION_RULES),
        infer_shapes=True,
        portable=True,
    ),
    FusionSpec(
        "fuse-gelu",
        "Erf and tanh GELU formulas become one com.microsoft Gelu/FastGelu node.",
        _rules(erfgelu.rules, gelu.gelu_rules, tanh_gelu_rules),
    ),
    FusionSpec(
        "fuse-skip-layernorm",
        "Add + LayerNormalization become SkipLayerNormalization (bias folded in).",
        _rules(skip_normalization.skip_layer_normalization_ruleset),
        infer_shapes=True,
        declines=skip_layernorm_slower,
    ),
    FusionSpec(
        "fuse-causal-attention",
        "GPT-2 style causal attention (packed QKV, Split, Where over a triangular buffer, "
        "padding mask) becomes one com.microsoft Attention, unidirectional (Kiln rule).",
        _rules(rewrite_rules.causal_attention_rules),
        infer_shapes=True,
    ),
    FusionSpec(
        "fuse-attention",
        "Any self-attention block (Softmax(Q·Kᵀ·scale + mask)·V over projections of one input) "
        "becomes com.microsoft Attention, once running the block beside it agrees, causal or "
        "not (Kiln rule).",
        _rules(probed_attention_rules),
        infer_shapes=True,
    ),
]

FUSIONS: list[FusionSpec] = [
    *_EARLY,
    # Fused attention states its output shape, where the exported merge of heads lost it:
    # the Linear after it and the residual LayerNorm can now be fused too.
    *(spec for spec in _EARLY if spec.name in ("gemm-as-matmul", "fuse-skip-layernorm")),
    FusionSpec(
        "fuse-sdpa",
        "Scaled dot-product attention (Q·Kᵀ, scale, mask, softmax, ·V) is recognised as one "
        "SDPA unit for the attention fusions that follow.",
        _rules(sdpa.sdpa_rules),
        infer_shapes=True,
    ),
    FusionSpec(
        "fuse-mha",
        "SDPA with its head reshapes/transposes becomes com.microsoft MultiHeadAttention.",
        _rules(mha.mha_rules_no_past, mha.mha_rules_with_past),
        infer_shapes=True,
    ),
    FusionSpec(
        "fuse-padding-mask",
        "A BERT-style extended mask feeding attention becomes the 2-D padding mask itself "
        "(Kiln rule).",
        _rules(rewrite_rules.padding_mask_rules),
        infer_shapes=True,
    ),
    FusionSpec(
        "fuse-masked-attention",
        "Q/K/V projections + attention with a padding mask become one com.microsoft "
        "Attention with packed weights (Kiln rule).",
        _rules(rewrite_rules.packed_attention_rules),
        infer_shapes=True,
    ),
    FusionSpec(
        "fuse-mha-bias",
        "Projection biases and the scale move into MultiHeadAttention.",
        _rules(internals.MHA_SCALE_RULES, mha_bias.mha_bias_rules),
        infer_shapes=True,
    ),
    FusionSpec(
        "fuse-packed-attention",
        "Three Q/K/V projections of one input + MultiHeadAttention become one Attention node.",
        _rules(attention.attention_rules),
        infer_shapes=True,
    ),
    FusionSpec(
        "fuse-bias-gelu",
        "Add(bias) + Gelu becomes BiasGelu.",
        _rules(bias_gelu.bias_gelu_rules),
    ),
    FusionSpec(
        "sdpa-to-mha",
        "Any SDPA left unfused is expressed as MultiHeadAttention so it runs as one kernel.",
        _rules(internals.SDPA_VIA_MHA_RULES),
        infer_shapes=True,
    ),
    FusionSpec(
        "fuse-gemm",
        "2-D MatMul + Add (and transposes around it) become one Gemm with the bias inside.",
        _rules(internals.MATMUL_ADD_TO_GEMM_RULES),
        infer_shapes=True,
        portable=True,
    ),
    FusionSpec(
        "fuse-matmul",
        "Transposes and scalar scales around MatMul fold into FusedMatMul; softmax "
        "upcast/downcast pairs are removed.",
        _rules(fused_matmul_rule_sets.fused_matmul_rule_sets(), softmax.rules),
    ),
]


class FusionPass(KilnPass):
    """A pass that applies one FusionSpec's rules to the whole model, subgraphs included
    (the rewriter and dead-code removal walk If/Loop/Scan bodies; a rule that would leave a
    body output made outside the body is caught by the pipeline and the pass dropped)."""

    stage = "fuse"

    def __init__(self, spec: FusionSpec) -> None:
        super().__init__()
        self.spec = spec
        self.name = spec.name
        self.engines = None if spec.portable else frozenset({"ort"})
        self.summary = spec.guarantee

    def apply(self, model: ir.Model) -> int:
        rules = self.spec.rules()
        if not rules:
            return 0
        if self.spec.declines is not None:
            self.note = self.spec.declines(model) or ""
            if self.note:
                return 0
        total = 0
        for _ in range(MAX_ROUNDS if self.spec.infer_shapes else 1):
            if self.spec.infer_shapes:
                # Re-inferred with the dims RefineShapes names (plain inference would forget
                # them); a dim named only now frees the shape reads that block a replacement.
                RefineShapesPass().apply(model)
                ShapeReadsPass().apply(model)
            count = pattern.RewriteRuleSet(rules).apply_to_model(model)
            # Dead leftovers (e.g. a Shape feeding a replaced Expand) would block later rules,
            # which refuse to replace nodes whose values have other users.
            common.RemoveUnusedNodesPass()(model)
            total += count
            if not count:
                break
        return total
