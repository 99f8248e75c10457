"""Static cost of a model: FLOPs and bytes moved per node, and the roofline (never runs it)."""

from kiln.cost.flops import count_flops, count_flops_by_node, count_flops_by_op
from kiln.cost.model import NodeCost, node_costs, total_cost, unknown_ops
from kiln.cost.roofline import peak_compute, roofline

__all__ = [
    "NodeCost",
    "count_flops",
    "count_flops_by_node",
    "count_flops_by_op",
    "node_costs",
    "peak_compute",
    "roofline",
    "total_cost",
    "unknown_ops",
]
