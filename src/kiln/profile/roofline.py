"""Roofline placement of each kernel against the measured roofs (arithmetic: kiln.cost).

A kernel's efficiency is its roofline time (the least time the machine's limits allow for its
FLOPs and bytes) over its measured time: 1 is on the roof; far below it, the time goes to
something the roofline does not model (dispatch, threads waking, small shapes). Each kernel
meets the roofs of the precision it ran in (read back from the engine where it says) and of
the level of the memory hierarchy its working set fits in (kiln.cost.roofline).
"""

from __future__ import annotations

from typing import Any

from kiln.cost import NodeCost, peak_compute, roofline

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
    node["memory_level"] = placed["memory_level"]
    node["bandwidth_gbs"] = placed["bandwidth_gbs"]
    node["achieved_gflops"] = placed["achieved_gflops"]
    node["roof_gflops"] = placed["attainable_gflops"]
    node["roofline_ms"] = placed["roofline_seconds"] * 1e3
    node["efficiency"] = placed["fraction"]
    node["bound"] = placed["bound"]


def roofs(peaks: Any) -> dict[str, Any]:
    """The roofs to draw: one compute line per measured precision, one memory slope per
    level of the memory hierarchy measured (DRAM always; L2 and L3 where measured)."""
    compute = {"fp32": peaks.fp32_gflops, "bf16": peaks.bf16_gflops, "int8": peaks.int8_gops}
    out = {
        "bandwidth_gbs": float(peaks.bandwidth_gbs),
        "memory": {name: float(speed) for name, _, speed in peaks.memory_levels()},
        "compute": {k: float(v) for k, v in compute.items() if v},
    }
    out["ridge_fp32"] = out["compute"]["fp32"] / out["bandwidth_gbs"]
    return out


def mixed_peak(nodes: list[dict[str, Any]], peaks: Any) -> tuple[float, str]:
    """(GFLOP/s, precision) of the peak that all the kernels' FLOPs meet, each at its own
    precision's peak (their FLOP-weighted harmonic mean): "fp32", "int8", or "mixed"."""
    seconds, flops, used = 0.0, 0.0, set()
    for node in nodes:
        if not node.get("flops"):
            continue
        peak, precision = peak_compute(peaks, node["precision"])
        seconds += node["flops"] / peak
        flops += node["flops"]
        used.add(precision)
    if not flops:
        return float(peaks.fp32_gflops), "fp32"
    return flops / seconds, used.pop() if len(used) == 1 else "mixed"
