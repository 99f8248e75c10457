"""Drop Reshapes whose output has exactly their input's shape.

PyTorch exports reshape attention context to the shape it already has (`reshape(B, -1, S, D)`
on a [B, H, S, D] tensor), through a target computed at run time. Once shape inference has
named every dim of both sides, the two shapes are provably equal and the Reshape is an
identity that would only stand between attention and its fusion.
"""

from __future__ import annotations

import onnx_ir as ir

from kiln.passes.base import KilnPass


def _fully_known(shape: ir.Shape | None) -> bool:
    return shape is not None and all(isinstance(d, int) or d.value for d in shape)


class NoopReshapesPass(KilnPass):
    """Guarantee: outputs unchanged; a Reshape is removed only when both shapes are fully
    named and equal dim by dim, and never when its output is a graph output. Reaches If
    branches; skips Loop/Scan bodies and functions, whose shapes may hold for one iteration
    or one call only."""

    name = "drop-noop-reshapes"
    stage = "simplify"
    summary = "Remove Reshapes whose named output shape equals their input's."

    def apply(self, model: ir.Model) -> int:
        count = 0
        nodes = ir.traversal.RecursiveGraphIterator(model.graph, recursive=_once)
        for node in [n for n in nodes if n.op_type == "Reshape" and not n.domain]:
            data, out = node.inputs[0], node.outputs[0]
            if data is None or out.is_graph_output():
                continue  # a graph output is its graph's interface, in a branch as in the model
            if not (_fully_known(data.shape) and _fully_known(out.shape)):
                continue
            if [str(d) for d in data.shape] != [str(d) for d in out.shape]:
                continue
            ir.convenience.replace_all_uses_with(out, data)
            count += 1
        return count


def _once(node: ir.Node) -> bool:
    """Bodies whose values have one shape per run: If branches run at most once."""
    return node.op_type == "If" and node.domain in ("", "ai.onnx")
