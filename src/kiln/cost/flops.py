"""Matrix-product FLOPs of an ONNX model: 2 × the multiply-accumulates :func:`node_costs` counts.

This is the figure papers and model cards publish (ResNet-50 8.18 GFLOP, BERT-base 22.35 at
seq 128): MatMul, Gemm, Conv (grouped, depthwise and N-D included), ConvTranspose, Einsum and
their fused and quantized forms (FusedMatMul, MatMulInteger, QLinearConv, Attention, ...),
without the elementwise work (bias adds, normalisations, activations, Softmax, pooling) that
:class:`~kiln.cost.NodeCost.flops` adds. There is one counter: these functions only sum the
``macs`` of :func:`kiln.cost.node_costs`, so the two always agree.
"""

from __future__ import annotations

from collections.abc import Mapping

import onnx

from kiln.cost.formulas import MATRIX_OPS
from kiln.cost.model import node_costs
from kiln.errors import KilnError


def count_flops(model: onnx.ModelProto, dims: Mapping[str, int] | None = None) -> int:
    """Total FLOPs (2 per multiply-accumulate) of the matrix products of the main graph.

    ``dims`` gives a value to each symbolic input dim (e.g. ``{"batch": 1, "seq": 128}``);
    dims it leaves out are taken from the model's ``kiln.dims`` metadata when present.
    Raises KilnError when a dim has no value or a matrix product's shapes stay unknown.
    """
    return sum(count_flops_by_node(model, dims).values())


def count_flops_by_op(
    model: onnx.ModelProto, dims: Mapping[str, int] | None = None
) -> dict[str, int]:
    """FLOPs per operator type (only ops with matrix products appear)."""
    out: dict[str, int] = {}
    for op_type, flops in _by_node(model, dims).values():
        out[op_type] = out.get(op_type, 0) + flops
    return out


def count_flops_by_node(
    model: onnx.ModelProto, dims: Mapping[str, int] | None = None
) -> dict[str, int]:
    """FLOPs per node with matrix products, keyed as :func:`kiln.cost.node_costs` keys it
    (node name, ``#index:OpType`` for unnamed nodes)."""
    return {key: flops for key, (_, flops) in _by_node(model, dims).items()}


def _by_node(model: onnx.ModelProto, dims: Mapping[str, int] | None) -> dict[str, tuple[str, int]]:
    """key -> (op type, FLOPs) of every node with matrix products, in graph order; KilnError
    for one whose cost is unknown (a FLOP count that silently drops a product is wrong)."""
    out: dict[str, tuple[str, int]] = {}
    for key, cost in node_costs(model, dims).items():
        if cost.op_type not in MATRIX_OPS:
            continue
        if not cost.known:
            raise KilnError(
                f"model {model.graph.name!r}: cannot count FLOPs of node {key!r} "
                f"({cost.op_type}): a shape it needs is unknown after shape inference; "
                "give the model's symbolic dims static values, or check the node's inputs"
            )
        out[key] = (cost.op_type, 2 * cost.macs)
    return out
