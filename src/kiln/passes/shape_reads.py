"""Read shapes from graph inputs instead of from intermediate tensors.

Exporters compute reshape targets and scales from `Shape(intermediate)`. Those reads are extra
users of values inside attention blocks, and a fusion must not remove a node whose output is
still used, so they block it. Where shape inference has named a dim after a graph input's dim
(or fixed it as a number) the read is rewritten to come from that input (or a constant), and
the intermediate is free to be fused.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kiln.passes.base import KilnPass


def _dim_sources(model: ir.Model) -> dict[str, tuple[ir.Value, int]]:
    sources: dict[str, tuple[ir.Value, int]] = {}
    for value in model.graph.inputs:
        for axis, dim in enumerate(value.shape or []):
            if not isinstance(dim, int) and dim.value and str(dim) not in sources:
                sources[str(dim)] = (value, axis)
    return sources


def _replacement(node: ir.Node, sources: dict[str, tuple[ir.Value, int]]) -> list[ir.Node] | None:
    value = node.inputs[0]
    if value is None or value.shape is None or value.producer() is None:
        return None
    rank = value.shape.rank()
    start = node.attributes.get_int("start", 0)
    end = node.attributes.get_int("end", rank)
    dims = list(value.shape)[slice(start, end)]
    pieces: list[ir.Node] = []
    for index, dim in enumerate(dims):
        name = f"{node.name}.dim{index}"
        if isinstance(dim, int):
            tensor = ir.tensor(np.array([dim], np.int64), name=name)
            pieces.append(ir.node("Constant", [], {"value": tensor}, name=name))
        elif str(dim) in sources:
            graph_input, axis = sources[str(dim)]
            attributes = {"start": axis, "end": axis + 1}
            pieces.append(ir.node("Shape", [graph_input], attributes, name=name))
        else:
            return None
    inputs = [p.outputs[0] for p in pieces]
    pieces.append(ir.node("Concat", inputs, {"axis": 0}, name=f"{node.name}.concat"))
    return pieces


class ShapeReadsPass(KilnPass):
    """Guarantee: outputs unchanged; only where shape values are read from changes.

    Skips If/Loop/Scan bodies: it rewrites Shape nodes of the main graph only (their
    replacements live there too, so bodies that read them still see them)."""

    name = "detach-shape-reads"
    stage = "simplify"
    summary = "Read dims from graph inputs, not from tensors that fusions must consume."

    def apply(self, model: ir.Model) -> int:
        sources = _dim_sources(model)
        count = 0
        for node in [n for n in model.graph if n.op_type == "Shape" and not n.domain]:
            pieces = _replacement(node, sources)
            if pieces is None:
                continue
            model.graph.insert_before(node, pieces)
            for piece in pieces:
                piece.outputs[0].name = piece.name
            ir.convenience.replace_all_uses_with(node.outputs[0], pieces[-1].outputs[0])
            count += 1
        return count
