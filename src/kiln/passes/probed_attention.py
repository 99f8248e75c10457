"""A rule: any multi-head self-attention block whose output is Softmax(scores)·V merged back
from heads becomes one com.microsoft Attention (packed Q|K|V weights, the 2-D padding mask,
`unidirectional` for causal blocks).

Exporters write the same block many ways: TorchScript and dynamo, BERT and GPT-2, with and
without an attention_mask input, eager or SDPA attention (K transposed by one Transpose, by
two, or by Reshape → Transpose → Reshape; the 1/√d scale on the scores or split as
1/⁴√d on Q and K; causal masks by Trilu, by a sliced buffer or by comparing two Ranges).
Rather than one pattern per spelling, the rule matches the part all share, walks back to
the projections (`attention_trace`), and runs the block beside the candidate to prove they
agree (`attention_probe`). Each check fails with the reason `optimize` reports.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from kiln.ir.provenance import MODULE_KEY, ORIGIN_KEY, SOURCE_KEY, join_origins, split_origins
from kiln.passes.attention_probe import Candidate, causal_flag
from kiln.passes.attention_trace import NotAttention, heads_projection, scalar, scores_parts

ZERO_ONLY = 0.0


class ProbedAttention(pattern.RewriteRuleClassBase):
    """`nan_guard`: the block keeps Where(IsNaN(p), 0, p) after Softmax (dynamo's SDPA for
    fully masked rows); `reshaped`: the context goes through a Reshape to the same 4-D shape
    before the heads are merged (TorchScript's eager attention)."""

    def __init__(self, nan_guard: bool, reshaped: bool) -> None:
        guard, reshape = "NanGuard" if nan_guard else "", "Reshaped" if reshaped else ""
        super().__init__(f"ProbedAttention{guard}{reshape}")
        self._nan_guard, self._reshaped = nan_guard, reshaped

    def pattern(self, op, scores, v, merged_shape):
        probs = op.Softmax(scores, _outputs=["probs"])
        if self._nan_guard:
            probs = op.Where(op.IsNaN(probs), pattern.Var("zero"), probs)
        context = op.MatMul(probs, v)
        if self._reshaped:
            context = op.Reshape(context, pattern.Var("heads_shape"), _allow_other_attributes=True)
        return op.Reshape(
            op.Transpose(context, perm=[0, 2, 1, 3]), merged_shape,
            _allow_other_attributes=True, _outputs=["out"],
        )  # fmt: skip

    def check(self, context, scores, v, probs, out, zero=None, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if zero is not None and scalar(zero) != ZERO_ONLY:
            return result.fail("the NaN guard after Softmax does not write 0", zero)
        axis = probs.producer().attributes.get_int("axis", -1)
        rank = probs.shape.rank() if probs.shape is not None else None
        if rank != 4 or axis not in (-1, 3):
            return result.fail("Softmax is not over the last axis of 4-D scores", probs)
        heads = probs.shape[1]
        if not isinstance(heads, int):
            return result.fail(f"the number of heads is not static ({probs.shape})", probs)
        if out.shape is None or out.shape.rank() not in (2, 3):
            return result.fail("the merged heads are not [batch, seq, hidden]", out)
        try:
            self._candidate = _candidate(scores, v, heads)
            self._causal = causal_flag(context.model, out, self._candidate)
        except NotAttention as reason:
            return result.fail(str(reason))
        return result

    def rewrite(self, op, out, **_):
        candidate = self._candidate
        name = candidate.x.name or "attention"
        weight = op.initializer(ir.tensor(candidate.weight), name=f"{name}.kiln_qkv_weight")
        bias = op.initializer(ir.tensor(candidate.bias), name=f"{name}.kiln_qkv_bias")
        inputs = [candidate.x, weight, bias]
        if candidate.mask is not None:
            inputs.append(op.Cast(candidate.mask, to=ir.DataType.INT32))
        attention = op.Attention(
            *inputs, num_heads=candidate.heads, scale=candidate.scale,
            unidirectional=self._causal, _domain="com.microsoft",
        )  # fmt: skip
        _stamp_block(attention.producer(), candidate.block)
        if out.shape.rank() == 2:  # the merge fed a Gemm directly: keep its 2-D view
            hidden = candidate.weight.shape[1] // 3
            shape = op.initializer(ir.tensor(np.array([-1, hidden], np.int64)),
                                   name=f"{name}.kiln_flat_shape")  # fmt: skip
            return op.Reshape(attention, shape)
        return attention


def _stamp_block(fused: ir.Node, block: list[ir.Node]) -> None:
    """Provenance for the whole block, not only the matched part: the projections, head
    reshapes and mask ops the rule walked past are replaced too. Only nodes that die with
    the block count: shape and mask ops shared with other layers stay theirs."""
    root, dying = block[-1], set(block)
    changed = True
    while changed:  # drop every node whose outputs something outside the block still reads
        outside = {n for n in dying if n is not root and any(
            user not in dying for v in n.outputs for user, _ in v.uses())}  # fmt: skip
        dying -= outside
        changed = bool(outside)
    for key, split, join in (
        (ORIGIN_KEY, split_origins, join_origins),
        (MODULE_KEY, split_origins, join_origins),
        (
            SOURCE_KEY,
            lambda text: set(text.split("\n")) - {""},
            lambda parts: "\n".join(sorted(parts)),
        ),
    ):
        parts = set().union(*(split(n.metadata_props.get(key, "")) for n in dying))
        if parts:
            fused.metadata_props[key] = join(parts)


def _candidate(scores: ir.Value, v: ir.Value, heads: int) -> Candidate:
    q, k, _mask, factor = scores_parts(scores)  # the mask is proven by the probe
    (pq, fq), (pk, fk), (pv, fv) = (heads_projection(t) for t in (q, k, v))
    if not (pq.x is pk.x is pv.x):
        raise NotAttention("Q, K and V are not projections of one input (not self-attention)")
    if fv != 1.0:
        raise NotAttention("V is scaled")
    hidden = pq.weight.shape[1]
    if pk.weight.shape[1] != hidden or pv.weight.shape[1] != hidden or hidden % heads:
        raise NotAttention(f"Q, K and V widths do not split into {heads} equal heads")
    x = pq.x
    if x.shape is None or x.shape.rank() != 3:
        raise NotAttention(f"the projections' input {x.name} is not [batch, seq, hidden]")
    weight = np.concatenate([pq.weight, pk.weight, pv.weight], axis=1).astype(np.float32)
    packed_bias = np.concatenate([pq.bias, pk.bias, pv.bias]).astype(np.float32)
    return Candidate(x, weight, packed_bias, heads, factor * fq * fk, None)


probed_attention_rules = pattern.RewriteRuleSet(
    [ProbedAttention.rule(nan_guard=guard, reshaped=reshaped)
     for guard in (True, False) for reshaped in (True, False)]
)  # fmt: skip
