"""Split attention's key Transpose(0, 2, 3, 1) into the head split and the K^T a MatMul reads.

Exporters write `K^T` for `Q · K^T` as one Transpose from [batch, seq, heads, dim] straight to
[batch, heads, dim, seq] (perm 0, 2, 3, 1). OpenVINO's CPU plugin folds Q's and V's head
split (perm 0, 2, 1, 3) into its fused attention kernel, and a trailing (0, 1, 3, 2) into the
MatMul as transpose_b, but not the one-step (0, 2, 3, 1) on an int8 K: NNCF's int8 bert-base
runs it as twelve reference-kernel transposes. Written as two, both fold: a small gain over the
NNCF recipe, outputs bit-identical (the key Transpose note in
docs/contributing/engine-notes.md).

Kiln applies it to its OpenVINO int8 graphs after NNCF (`kiln.precision.quantizers`), never
to the hand-run peers `kiln bench` measures.
"""

from __future__ import annotations

import onnx_ir as ir

from kiln.passes.base import KilnPass

_KEY_T = (0, 2, 3, 1)
_HEADS, _SWAP_LAST = (0, 2, 1, 3), (0, 1, 3, 2)


class KeyTransposeSplitPass(KilnPass):
    """Guarantee: outputs bit-identical (two permutations composing to the one they replace).
    Rewrites only a rank-4 Transpose(0, 2, 3, 1) whose every use is a MatMul's second input;
    any other reader keeps the tensor it read. Top-level graph only."""

    name = "split-key-transpose"
    stage = "precision"
    summary = "Write K^T's Transpose(0,2,3,1) as the head split then (0,1,3,2): both fuse."

    def apply(self, model: ir.Model) -> int:
        count = 0
        for node in [n for n in model.graph if _is_key_transpose(n)]:
            split = node.outputs[0]  # K^T until now; the head split from here on
            uses = list(split.uses())
            node.attributes["perm"] = ir.AttrInt64s("perm", list(_HEADS))
            swap = ir.node(
                "Transpose",
                [split],
                attributes={"perm": list(_SWAP_LAST)},
                name=f"{node.name}.swap_last",
            )
            key_t = swap.outputs[0]
            # The MatMul goes on reading the name it read; the head split gets a new one.
            key_t.name, split.name = split.name, f"{split.name}.heads"
            key_t.type, key_t.shape = split.type, split.shape
            split.shape = _permuted(split.shape)
            model.graph.insert_after(node, swap)
            for user, index in uses:
                user.replace_input_with(index, key_t)
            count += 1
        return count


def _is_key_transpose(node: ir.Node) -> bool:
    if node.op_type != "Transpose" or node.domain or node.inputs[0] is None:
        return False
    if tuple(node.attributes.get_ints("perm", ())) != _KEY_T:
        return False
    uses = list(node.outputs[0].uses())
    if not uses or node.outputs[0].is_graph_output():
        return False
    return all(user.op_type == "MatMul" and index == 1 for user, index in uses)


def _permuted(shape: ir.Shape | None) -> ir.Shape | None:
    """The head split's shape, from K^T's [b, h, d, s]: [b, h, s, d]."""
    if shape is None or len(shape) != 4:
        return None
    return ir.Shape([shape[i] for i in _SWAP_LAST])
