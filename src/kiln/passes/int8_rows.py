"""Gather an int8 embedding table's rows before dequantizing them.

NNCF quantizes an embedding table as `DequantizeLinear(q, s, zp, axis=0)` read by a row
Gather. OpenVINO folds a DequantizeLinear of a constant into an fp32 constant when it
compiles, so bert-base's 22 MiB int8 word table was held as 89 MiB of fp32. Gathered first,
only the rows a request reads are dequantized: `(Gather(q) − Gather(zp)) × Gather(s)`.

Kiln applies it to its own OpenVINO int8 artifacts (`kiln.precision.quantizers`), never to the
hand-run NNCF peers `kiln bench` measures: those stay what NNCF gives a user.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kiln.passes.base import KilnPass


class Int8RowsPass(KilnPass):
    """Guarantee: outputs bit-identical (the same integers times the same scales). Rewrites
    only a per-row DequantizeLinear of a constant table that row Gathers alone read; a table
    anything else reads (a tied output head) stays as it is. Top-level graph only: NNCF
    quantizes no table inside a branch."""

    name = "gather-int8-rows"
    stage = "precision"
    summary = "Gather an int8 embedding table's rows, then dequantize only those."

    def apply(self, model: ir.Model) -> int:
        count = 0
        for dq in [n for n in model.graph if _is_row_table(n)]:
            for gather, _ in list(dq.outputs[0].uses()):
                tape = ir.tape.Tape()
                out = _dequantized_rows(tape, dq, gather)
                model.graph.insert_before(gather, tape.nodes)
                name = gather.outputs[0].name
                ir.convenience.replace_all_uses_with(
                    gather.outputs[0], out, replace_graph_outputs=True
                )
                model.graph.remove(gather, safe=True)
                out.name = name  # a graph output keeps its name
                count += 1
            model.graph.remove(dq, safe=True)
        return count


def _dequantized_rows(tape: ir.tape.Tape, dq: ir.Node, gather: ir.Node) -> ir.Value:
    """`DequantizeLinear(q, s, zp, axis=0)[ids]` as the rows gathered, then dequantized; the
    nodes named after the Gather they replace (a profile then still says which table)."""
    q, scale, zero = (*dq.inputs, None)[:3]
    ids, to, at = gather.inputs[1], {"to": scale.dtype}, f"{gather.name}.int8"

    def op(kind: str, inputs: list, role: str, **attributes: object) -> ir.Value:
        return tape.op(kind, inputs, attributes=attributes or None, name=f"{at}.{role}")

    last = op("Constant", [], "last_axis", value=ir.tensor(np.array([-1])))
    rows = op("Cast", [op("Gather", [q, ids], "rows")], "rows_cast", **to)
    if zero is not None:
        zeros = op("Cast", [op("Gather", [zero, ids], "zero_points")], "zero_points_cast", **to)
        rows = op("Sub", [rows, op("Unsqueeze", [zeros, last], "zero_points_axis")], "centred")
    scales = op("Unsqueeze", [op("Gather", [scale, ids], "scales"), last], "scales_axis")
    return op("Mul", [rows, scales], "dequantized")


def _is_row_table(node: ir.Node) -> bool:
    """A per-row (axis 0) DequantizeLinear of a constant table that only row Gathers read."""
    if node.op_type != "DequantizeLinear" or node.domain or node.inputs[0] is None:
        return False
    table, scale = node.inputs[0], node.inputs[1]
    if table.const_value is None or scale is None or scale.const_value is None:
        return False
    if scale.shape is None or len(scale.shape) != 1 or node.attributes.get_int("axis", 1) != 0:
        return False
    uses = list(node.outputs[0].uses())
    return bool(uses) and all(
        user.op_type == "Gather" and index == 0 and user.attributes.get_int("axis", 0) == 0
        for user, index in uses
    )
