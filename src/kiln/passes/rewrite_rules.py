"""Kiln's own fusion rules, for patterns onnxscript's `ort_fusions` leave half-done.

Same style as `onnxscript.rewriter.ort_fusions`: a pattern, a check, a replacement.
Both rules assume attention masks hold 0/1, as every tokenizer emits and as ONNX Runtime's
own transformers optimizer also assumes.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern

from kiln.ir.onnxscript_internals import get_numpy_value


def _scalar(value: ir.Value | None) -> float | None:
    const = get_numpy_value(value) if value is not None else None
    if const is None or const.size != 1:
        return None
    return float(const.reshape(()))


class PaddingMaskAttention(pattern.RewriteRuleClassBase):
    """MultiHeadAttention whose bias is BERT's extended mask, (1 − mask)·c broadcast by Expand.

    ONNX Runtime takes the 2-D 0/1 mask itself as `key_padding_mask` and adds c
    (`mask_filter_value`) where it is 0: the same scores, without materialising a
    [batch, 1, seq, seq] tensor, and it frees the query projection for the bias fusion.
    """

    def pattern(self, op, query, key, value, extended, shape, num_heads):
        return op.MultiHeadAttention(
            query,
            key,
            value,
            pattern.Var("bias", can_match_none=True),
            None,
            op.Expand(extended, shape),
            None,
            None,
            num_heads=num_heads,
            scale=pattern.AttrVar("scale", can_match_none=True),
            _domain="com.microsoft",
        )

    def check(self, context, extended, **_) -> pattern.MatchResult:
        # The mask chain is shared by every layer, so it is read here rather than matched
        # (matched nodes with other users cannot be replaced); it dies once all layers move.
        result = pattern.MatchResult()
        found = _padding_mask(extended)
        if found is None:
            return result.fail("attention bias is not (1 - Cast(Unsqueeze(mask))) * c", extended)
        self._mask, self._fill = found
        return result

    def rewrite(self, op, query, key, value, num_heads, bias=None, scale=None, **_):
        attributes = {"num_heads": num_heads, "mask_filter_value": self._fill}
        if scale is not None:
            attributes["scale"] = scale.value
        return op.MultiHeadAttention(
            query,
            key,
            value,
            bias,
            op.Cast(self._mask, to=ir.DataType.INT32),
            _domain="com.microsoft",
            **attributes,
        )


def _producer(value: ir.Value | None, op_type: str) -> ir.Node | None:
    node = value.producer() if value is not None else None
    return node if node is not None and node.op_type == op_type and not node.domain else None


def _padding_mask(extended: ir.Value) -> tuple[ir.Value, float] | None:
    """(mask, c) if `extended` = (1 − Cast(Unsqueeze(mask, [1, 2]))) · c with a 2-D mask."""
    mul = _producer(extended, "Mul")
    sub = _producer(mul.inputs[0], "Sub") if mul else None
    cast = _producer(sub.inputs[1], "Cast") if sub else None
    unsqueeze = _producer(cast.inputs[0], "Unsqueeze") if cast else None
    if not (mul and sub and cast and unsqueeze) or _scalar(sub.inputs[0]) != 1.0:
        return None
    fill, axes, mask = _scalar(mul.inputs[1]), unsqueeze.inputs[1], unsqueeze.inputs[0]
    axes_value = get_numpy_value(axes)
    if fill is None or axes_value is None or sorted(axes_value.tolist()) != [1, 2]:
        return None
    if mask is None or mask.shape is None or mask.shape.rank() != 2:
        return None
    return mask, fill


class PackedAttentionWithMask(pattern.RewriteRuleClassBase):
    """Q/K/V projections (MatMul + bias) of one input + MultiHeadAttention with a padding
    mask → one com.microsoft Attention: a single [hidden, 3·hidden] GEMM and ONNX Runtime's
    fused CPU kernel. onnxscript's packing rules only handle attention without such a mask.
    """

    def pattern(self, op, x, wq, wk, wv, bq, bk, bv, mask, num_heads):
        return op.MultiHeadAttention(
            op.Add(op.MatMul(x, wq), bq),
            op.Add(op.MatMul(x, wk), bk),
            op.Add(op.MatMul(x, wv), bv),
            None,
            mask,
            None,
            None,
            None,
            num_heads=num_heads,
            mask_filter_value=pattern.AttrVar("mask_filter_value", can_match_none=True),
            scale=pattern.AttrVar("scale", can_match_none=True),
            _domain="com.microsoft",
        )

    def check(self, context, wq, wk, wv, bq, bk, bv, mask, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        weights = [get_numpy_value(w) for w in (wq, wk, wv)]
        if any(w is None or w.ndim != 2 for w in weights):
            return result.fail("projection weights are not constant matrices")
        if len({w.shape for w in weights}) != 1:
            return result.fail("Q, K and V projections differ in shape")
        biases = [get_numpy_value(b) for b in (bq, bk, bv)]
        if any(b is None or b.shape != (weights[0].shape[1],) for b in biases):
            return result.fail("projection biases are not constant vectors")
        if mask.dtype != ir.DataType.INT32 or mask.shape is None or mask.shape.rank() != 2:
            return result.fail("mask is not a 2-D int32 padding mask")
        return result

    def rewrite(self, op, x, wq, wk, wv, bq, bk, bv, mask, num_heads, **kwargs):
        def packed(*values: ir.Value) -> np.ndarray:
            return np.concatenate([get_numpy_value(v) for v in values], axis=-1)

        # Named after the query weight, which is the one input unique to this layer (biases
        # may be shared once identical initializers are deduplicated).
        weight = op.initializer(ir.tensor(packed(wq, wk, wv)), name=f"{wq.name}.qkv_weight")
        bias = op.initializer(ir.tensor(packed(bq, bk, bv)), name=f"{wq.name}.qkv_bias")
        attributes = {"num_heads": num_heads}
        for name in ("mask_filter_value", "scale"):
            if kwargs.get(name) is not None:
                attributes[name] = kwargs[name].value
        return op.Attention(x, weight, bias, mask, _domain="com.microsoft", **attributes)


class CausalAttention(pattern.RewriteRuleClassBase):
    """GPT-2's attention block → one com.microsoft Attention with `unidirectional=1`.

    Matches the packed projection (MatMul + Add, Split in three), the head reshapes and
    transposes, scaled scores, the causal Where over a lower-triangular buffer, the additive
    padding mask, Softmax and the context merge. ONNX Runtime's kernel applies the causal
    and padding masks itself (masked scores get `mask_filter_value` instead of being
    replaced by it; after Softmax both are zero).
    """

    def pattern(
        self,
        op,
        x,
        w,
        b,
        splits,
        shape_q,
        shape_k,
        shape_v,
        shape_out,
        scale,
        causal,
        fill,
        extended,
    ):
        qkv = op.Add(op.MatMul(x, w), b)
        q, k, v = op.Split(qkv, splits, axis=2, _outputs=3)
        q = op.Transpose(op.Reshape(q, shape_q), perm=[0, 2, 1, 3])
        k = op.Transpose(op.Reshape(k, shape_k), perm=[0, 2, 3, 1])
        v = op.Transpose(op.Reshape(v, shape_v), perm=[0, 2, 1, 3])
        scores = op.Div(op.MatMul(q, k), scale)
        scores = op.Add(op.Where(causal, scores, fill), extended)
        context = op.MatMul(op.Softmax(scores, axis=-1), v)
        return op.Reshape(op.Transpose(context, perm=[0, 2, 1, 3]), shape_out)

    def check(self, context, w, b, splits, shape_q, scale, causal, fill, extended, **_):
        result = pattern.MatchResult()
        weight, bias = get_numpy_value(w), get_numpy_value(b)
        if weight is None or bias is None or weight.ndim != 2 or weight.shape[1] % 3:
            return result.fail("projection is not a constant [hidden, 3·hidden] matrix")
        hidden = weight.shape[1] // 3
        split_sizes = get_numpy_value(splits)
        if split_sizes is None or split_sizes.tolist() != [hidden] * 3:
            return result.fail("Split is not three equal parts")
        heads_shape = get_numpy_value(shape_q)
        if (
            heads_shape is None
            or heads_shape.size != 4
            or heads_shape[2] * heads_shape[3] != hidden
        ):
            return result.fail("head reshape is not [0, 0, heads, head_size]")
        if _scalar(scale) is None or _scalar(fill) is None or not _is_causal(causal):
            return result.fail("scale, fill or causal mask is not the GPT-2 form")
        found = _padding_mask(extended)
        if found is None:
            return result.fail("padding mask is not (1 - mask) * c")
        self._heads, self._head_size = int(heads_shape[2]), int(heads_shape[3])
        self._mask, self._fill = found[0], _scalar(fill)
        return result

    def rewrite(self, op, x, w, b, scale, **_):
        return op.Attention(
            x,
            w,
            b,
            op.Cast(self._mask, to=ir.DataType.INT32),
            num_heads=self._heads,
            unidirectional=1,
            scale=1.0 / _scalar(scale),
            mask_filter_value=self._fill,
            _domain="com.microsoft",
        )


def _is_causal(value: ir.Value) -> bool:
    """A Slice from the start of a constant lower-triangular [1, 1, n, n] boolean buffer."""
    node = _producer(value, "Slice")
    if node is None:
        return False
    buffer = get_numpy_value(node.inputs[0])
    starts = get_numpy_value(node.inputs[1])
    if buffer is None or starts is None or buffer.ndim != 4 or starts.any():
        return False
    square = buffer.reshape(buffer.shape[-2:]).astype(bool)
    return bool(np.array_equal(square, np.tril(np.ones_like(square))))


padding_mask_rules = pattern.RewriteRuleSet([PaddingMaskAttention.rule()])
# commute: exporters put the bias on either side of the Add.
packed_attention_rules = pattern.RewriteRuleSet([PackedAttentionWithMask.rule()], commute=True)
causal_attention_rules = pattern.RewriteRuleSet([CausalAttention.rule()])


# ONNX Runtime's FusedConv accepts these activations; Clip and LeakyRelu carry parameters.
_CONV_ACTIVATIONS = {"Relu", "Sigmoid", "Tanh", "LeakyRelu", "Clip", "HardSigmoid"}


class ConvActivation(pattern.RewriteRuleClassBase):
    """Conv followed by its activation → com.microsoft FusedConv: the activation is applied
    to each output tile while it is still in cache."""

    def __init__(self, activation: str) -> None:
        super().__init__(f"Conv{activation}")
        self._activation = activation

    def pattern(self, op, x, w):
        conv = op.Conv(x, w, pattern.Var("b", can_match_none=True), _outputs=["conv"])
        if self._activation == "Clip":
            return op.Clip(conv, pattern.Var("low"), pattern.Var("high"))
        return getattr(op, self._activation)(conv, _outputs=["act"])

    def check(self, context, low=None, high=None, **_) -> pattern.MatchResult:
        result = pattern.MatchResult()
        if self._activation == "Clip" and (_scalar(low) is None or _scalar(high) is None):
            return result.fail("Clip bounds are not constants")
        return result

    def rewrite(self, op, x, w, b=None, conv=None, low=None, high=None, act=None, **_):
        conv_node = conv.producer() if conv is not None else None
        attributes = dict(conv_node.attributes) if conv_node is not None else {}
        params: list[float] = []
        if self._activation == "Clip":
            params = [_scalar(low), _scalar(high)]
        elif act is not None and self._activation in ("LeakyRelu", "HardSigmoid"):
            node = act.producer()
            if self._activation == "LeakyRelu":
                params = [node.attributes.get_float("alpha", 0.01)]
            else:
                params = [
                    node.attributes.get_float("alpha", 0.2),
                    node.attributes.get_float("beta", 0.5),
                ]
        attributes["activation"] = ir.AttrString("activation", self._activation)
        if params:
            attributes["activation_params"] = ir.AttrFloat32s("activation_params", params)
        inputs = [x, w] + ([b] if b is not None else [])
        return op.FusedConv(*inputs, _domain="com.microsoft", **attributes)


conv_activation_rules = pattern.RewriteRuleSet(
    [ConvActivation.rule(activation) for activation in sorted(_CONV_ACTIVATIONS)]
)
