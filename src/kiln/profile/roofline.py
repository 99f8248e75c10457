"""Roofline placement of each kernel against the measured roofs (arithmetic: kiln.cost).

A kernel's efficiency is its roofline time (the least time the machine's limits allow for its
FLOPs and bytes) over its measured time: 1 is on the roof; far below it, the time goes to
something the roofline does not model (dispatch, threads waking, small shapes).
"""

from __future__ import annotations

from typing import Any

from kiln.cost import NodeCost, roofline

# Kernels that compute in int8 or bf16 have higher roofs than fp32 ones.
_INT8_OPS = ("MatMulInteger", "ConvInteger", "QLinear", "DynamicQuantize", "QGemm", "QAttention")


def precision_of(op_type: str, kernel: str) -> str:
    """fp32, bf16 or int8, from the operator and the kernel name the engine reports."""
    text = f"{op_type} {kernel}".lower()
    if any(op.lower() in text for op in _INT8_OPS) or "i8" in kernel.lower():
        return "int8"
    if "bf16" in text:
        return "bf16"
    return "fp32"


def place(node: dict[str, Any], peaks: Any) -> None:
    """Add roofline fields to a per-kernel entry that has flops, bytes and median_ms."""
    flops, nbytes, ms = node.get("flops"), node.get("bytes"), node["median_ms"]
    if flops is None or not nbytes or ms <= 0:
        return
    cost = NodeCost(node["op_type"], int(flops), int(nbytes), precision=node["precision"])
    placed = roofline(cost, ms / 1e3, peaks, node["precision"])
    node["intensity"] = placed["intensity"]
    node["achieved_gflops"] = placed["achieved_gflops"]
    node["roof_gflops"] = placed["attainable_gflops"]
    node["roofline_ms"] = placed["roofline_seconds"] * 1e3
    node["efficiency"] = placed["fraction"]
    node["bound"] = placed["bound"]


def roofs(peaks: Any) -> dict[str, Any]:
    """The roofs to draw: one compute line per measured precision, one memory slope."""
    compute = {"fp32": peaks.fp32_gflops, "bf16": peaks.bf16_gflops, "int8": peaks.int8_gops}
    out = {
        "bandwidth_gbs": float(peaks.bandwidth_gbs),
        "compute": {k: float(v) for k, v in compute.items() if v},
    }
    out["ridge_fp32"] = out["compute"]["fp32"] / out["bandwidth_gbs"]
    return out
