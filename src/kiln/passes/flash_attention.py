"""Long sequences through ONNX Runtime's flash attention, chosen per run, never losing a mask.

ONNX Runtime's CPU `Attention` (the op Kiln's attention fusions emit) builds every head's
S × S score matrix; only its `MultiHeadAttention` has a flash path (MLAS, tiled to the L2
cache), and only without a padding mask. A fixed graph cannot know whether a request's mask
is all ones, so each non-causal `Attention` becomes an `If`: when the mask (if any) is all
ones and the sequence is at least `FLASH_ROWS` long, the packed projection, a Split and a
mask-free `MultiHeadAttention`; otherwise the `Attention` node exactly as it was. Both
branches compute the same function: a padded request still takes the masked kernel. Only a
model compiled for at least `FLASH_ROWS` tokens (its static length, or the size `kiln.dims`
gives it: the zoo's, or the compile's `--shape`) is wrapped; a short one would pay the If
for nothing.

Measured, not assumed: how much the flash branch gains depends on the CPU and grows with the
length (the Attention note in docs/contributing/engine-notes.md; benchmarks/flash_attention.py
times it on an artifact). So the pass first times the two at the model's width and heads at
`FLASH_ROWS` (`kiln.passes.fused_op_pays.flash_attention_slower`) and leaves the graph alone,
saying so, where the flash branch is slower there in every round.
"""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir

from kiln.passes.base import KilnPass
from kiln.passes.fused_op_pays import FLASH_ROWS, flash_attention_slower
from kiln.passes.shape_reads import ShapeReadsPass

MS_DOMAIN = "com.microsoft"
MIN_OPSET = 13  # Split takes its sizes as an input from opset 13 (an attribute before)
# Attention's attributes the flash branch can honour; any other (past state, unequal Q/K/V
# widths, a rotary embedding) leaves the node as it is.
_KNOWN = {"num_heads", "scale", "mask_filter_value", "unidirectional"}


class FlashAttentionPass(KilnPass):
    """Guarantee: outputs unchanged for every mask and length (the masked or short case runs
    the original node); only self-attention `Attention` nodes with packed constant weights,
    no past state and no causal flag are wrapped."""

    name = "flash-attention"
    stage = "fuse"
    summary = (
        "Non-causal com.microsoft Attention runs mask-free MultiHeadAttention (ONNX Runtime's "
        f"CPU flash path) when the mask is all ones and the sequence ≥ {FLASH_ROWS} tokens, "
        "unless measured slower here."
    )
    engines = frozenset({"ort"})

    def apply(self, model: ir.Model) -> int:
        if model.opset_imports.get("", 1) < MIN_OPSET:
            return 0
        nodes = [n for n in model.graph if _wrappable(n)]
        lengths = {_compiled_length(model, n) for n in nodes}
        if not nodes or not any(n is not None and n >= FLASH_ROWS for n in lengths):
            return 0  # compiled for short sequences: the If would only cost
        shapes = {(_heads(n), _hidden(n)) for n in nodes}
        for heads, width in sorted(shapes):
            self.note = flash_attention_slower(heads, width) or ""
            if self.note:
                return 0
        conditions: dict[ir.Value, ir.Value] = {}
        for node in nodes:
            source = node.inputs[3] if len(node.inputs) > 3 and node.inputs[3] else node.inputs[0]
            if source not in conditions:
                conditions[source] = _condition(model.graph, node, source)
            _wrap(model.graph, node, conditions[source])
        # The length is read from the mask or x; from the graph input where shapes name it,
        # as every other shape read is (and a second pipeline run then changes nothing).
        ShapeReadsPass().apply(model)
        return len(nodes)


def _heads(node: ir.Node) -> int:
    return node.attributes.get_int("num_heads", 0)


def _hidden(node: ir.Node) -> int:
    return node.inputs[1].const_value.shape[1] // 3


def _compiled_length(model: ir.Model, node: ir.Node) -> int | None:
    """The sequence length Kiln compiles `node` for: its input's static dim, else the size the
    model's `kiln.dims` gives that dim (the zoo's, or the compile's `--shape` fit); else the
    same of its mask's last dim (a partition's piece starts from a hidden state whose dims
    shape inference could not name, beside the model's own attention_mask)."""
    try:
        dims = json.loads(model.metadata_props.get("kiln.dims", "{}"))
    except ValueError:
        dims = {}
    mask = node.inputs[3] if len(node.inputs) > 3 else None
    for dim in (_dim(node.inputs[0], 1), _dim(mask, -1)):
        if isinstance(dim, int):
            return dim
        size = dims.get(str(dim)) if isinstance(dims, dict) and dim is not None else None
        if isinstance(size, int):
            return size
    return None


def _dim(value: ir.Value | None, axis: int) -> int | ir.SymbolicDim | None:
    if value is None or value.shape is None or len(value.shape) < abs(axis) + (axis >= 0):
        return None
    return value.shape[axis]


def _wrappable(node: ir.Node) -> bool:
    if node.domain != MS_DOMAIN or node.op_type != "Attention" or len(node.outputs) != 1:
        return False
    if set(node.attributes) - _KNOWN or node.attributes.get_int("unidirectional", 0):
        return False
    if len(node.inputs) not in (3, 4) or any(v is None for v in node.inputs[:3]):
        return False
    x, weight, bias = node.inputs[:3]
    if weight.const_value is None or bias.const_value is None or len(weight.const_value.shape) != 2:
        return False
    heads = _heads(node)
    packed = weight.const_value.shape[1]
    if not isinstance(packed, int) or packed % 3 or heads <= 0 or (packed // 3) % heads:
        return False
    mask = node.inputs[3] if len(node.inputs) == 4 else None
    rank_two = mask is None or (mask.shape is not None and mask.shape.rank() == 2)
    return rank_two and x.shape is not None and x.shape.rank() == 3


def _condition(graph: ir.Graph, node: ir.Node, source: ir.Value) -> ir.Value:
    """A bool [1]: `source` (the 2-D mask, or x) spans ≥ FLASH_ROWS tokens and, for a mask,
    holds only ones. Computed once per mask and shared by every layer that reads it."""
    # Ops every opset from MIN_OPSET has (Shape's start/end need 15, GreaterOrEqual 12).
    rows = ir.node("Constant", [], attributes={"value": ir.tensor(np.array([FLASH_ROWS]))})
    axis = ir.node("Constant", [], attributes={"value": ir.tensor(np.array([1]))})
    shape = ir.node("Shape", [source])
    length = ir.node("Gather", [shape.outputs[0], axis.outputs[0]])
    short = ir.node("Less", [length.outputs[0], rows.outputs[0]])
    long = ir.node("Not", [short.outputs[0]])
    made = [rows, axis, shape, length, short, long]
    if source is not node.inputs[0]:  # a mask: every entry 1
        one = ir.node("Constant", [], attributes={"value": ir.tensor(np.array(1, np.int32))})
        made.append(one)
        if source.dtype != ir.DataType.INT32:  # Attention reads an int32 mask; so does Equal
            made.append(ir.node("Cast", [source], attributes={"to": ir.DataType.INT32}))
            source = made[-1].outputs[0]
        least = ir.node("ReduceMin", [source], attributes={"keepdims": 0})
        full = ir.node("Equal", [least.outputs[0], one.outputs[0]])
        made += [least, full, ir.node("And", [long.outputs[0], full.outputs[0]])]
    graph.insert_before(node, made)
    return made[-1].outputs[0]


def _wrap(graph: ir.Graph, node: ir.Node, condition: ir.Value) -> None:
    x, weight, bias = node.inputs[:3]
    heads, hidden = _heads(node), _hidden(node)
    sizes = ir.node("Constant", [], attributes={"value": ir.tensor(np.array([hidden] * 3))})
    packed = ir.node("MatMul", [x, weight])
    split = ir.node("Split", [packed.outputs[0], sizes.outputs[0]], attributes={"axis": -1},
                    num_outputs=3)  # fmt: skip
    kept = {k: a for k, a in node.attributes.items() if k in ("scale", "mask_filter_value")}
    flash = ir.node("MultiHeadAttention", [*split.outputs, bias], domain=MS_DOMAIN,
                    attributes={"num_heads": heads, **kept})  # fmt: skip
    masked = ir.node("Attention", list(node.inputs), domain=MS_DOMAIN,
                     attributes=dict(node.attributes))  # fmt: skip
    out = node.outputs[0]
    for made in (flash.outputs[0], masked.outputs[0]):
        made.type, made.shape = out.type, out.shape
    then_branch = ir.Graph([], [flash.outputs[0]], nodes=[sizes, packed, split, flash],
                           name=f"{node.name or 'attention'}_flash")  # fmt: skip
    else_branch = ir.Graph([], [masked.outputs[0]], nodes=[masked],
                           name=f"{node.name or 'attention'}_masked")  # fmt: skip
    choice = ir.node("If", [condition], attributes={"then_branch": then_branch,
                                                    "else_branch": else_branch})  # fmt: skip
    choice.outputs[0].type, choice.outputs[0].shape = out.type, out.shape
    choice.metadata_props.update(node.metadata_props)
    graph.insert_before(node, choice)
    base = node.name or out.name or "attention"
    # Names the outer graph cannot hold already: ONNX forbids a branch value shadowing one.
    named = {
        "sizes": sizes.outputs[0],
        "qkv": packed.outputs[0],
        "flash": flash.outputs[0],
        "masked": masked.outputs[0],
        **dict(zip("qkv", split.outputs, strict=True)),
    }
    for suffix, made in named.items():
        made.name = f"{base}.kiln_{suffix}"
    # Node names unique across branches too: a profile and provenance tell layers apart by them.
    for inner, suffix in ((sizes, "sizes"), (packed, "qkv_matmul"), (split, "split"),
                          (flash, "flash_mha"), (masked, "masked_attention")):  # fmt: skip
        inner.name = f"{base}.kiln_{suffix}"
    name = out.name
    ir.convenience.replace_all_uses_with(out, choice.outputs[0], replace_graph_outputs=True)
    graph.remove(node, safe=True)
    choice.outputs[0].name = name
