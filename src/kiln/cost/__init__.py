"""Static cost of a model: FLOPs of its multiply-accumulate operators (never runs the model)."""

from kiln.cost.flops import count_flops, count_flops_by_node, count_flops_by_op

__all__ = ["count_flops", "count_flops_by_node", "count_flops_by_op"]
