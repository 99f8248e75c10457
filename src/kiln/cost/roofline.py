"""The roofline: where a node's measured time sits against the machine's measured limits.

Pure arithmetic on a :class:`~kiln.cost.model.NodeCost`, a time and
:class:`~kiln.hardware.Peaks`; nothing is run here. The compute roof is the peak of the
precision the node computes in; the memory roof is the bandwidth of the smallest level of
the memory hierarchy its working set (the bytes it moves) fits in: a batch-1 layer whose
weights and activations fit in L2 is held to L2's bandwidth, not DRAM's.
"""

from __future__ import annotations

from typing import Any

from kiln.cost.model import NodeCost
from kiln.errors import KilnError
from kiln.hardware.peaks import Peaks

PRECISIONS = ("fp32", "fp16", "bf16", "int8")


def peak_compute(peaks: Peaks, precision: str) -> tuple[float, str]:
    """(GFLOP/s, precision whose peak it is) for arithmetic in ``precision``. Precisions this
    machine has no fast kernels for fall back to the fp32 peak (fp16 is computed in fp32 on
    CPUs)."""
    if precision not in PRECISIONS:
        raise KilnError(f"unknown precision '{precision}'; use one of {', '.join(PRECISIONS)}.")
    value = {"bf16": peaks.bf16_gflops, "int8": peaks.int8_gops}.get(precision)
    return (value, precision) if value else (peaks.fp32_gflops, "fp32")


def memory_roof(peaks: Peaks, working_set: float) -> tuple[float, str]:
    """(GB/s, level) for a node moving `working_set` bytes: the smallest cache that holds
    them, else memory. Peaks without cache ceilings give memory's bandwidth."""
    for name, size, speed in peaks.memory_levels():
        if size is None or working_set <= size:
            return speed, name
    return peaks.bandwidth_gbs, "DRAM"


def roofline(
    cost: NodeCost, seconds: float, peaks: Peaks, precision: str | None = None
) -> dict[str, Any]:
    """Place one node (or a whole model's total cost) measured at ``seconds`` on the roofline.

    ``precision`` picks the compute roof; None takes the node's own (``cost.precision``).
    Returns: intensity (FLOP/byte), memory_level and bandwidth_gbs (the level its bytes fit
    in, `memory_roof`), ridge (the intensity where the roofs meet), peak and
    attainable GFLOP/s (min(peak, intensity × bandwidth)), achieved GFLOP/s and GB/s,
    roofline_seconds (the least time the limits allow: max(flops/peak, bytes/bandwidth)),
    fraction (roofline_seconds / seconds, i.e. achieved / attainable; also meaningful for
    pure data movement) and bound ("compute" or "memory").
    """
    if not seconds > 0:
        raise KilnError(f"a roofline needs a positive time, got {seconds!r} s.")
    peak, used = peak_compute(peaks, precision or cost.precision)
    bandwidth, level = memory_roof(peaks, cost.bytes)
    intensity = cost.intensity
    compute_s = cost.flops / (peak * 1e9)
    memory_s = cost.bytes / (bandwidth * 1e9)
    roof_s = max(compute_s, memory_s)
    return {
        "op_type": cost.op_type,
        "flops": cost.flops,
        "bytes": cost.bytes,
        "seconds": seconds,
        "intensity": intensity,
        "memory_level": level,
        "bandwidth_gbs": bandwidth,
        "ridge": peak / bandwidth,
        "precision": used,
        "peak_gflops": peak,
        "attainable_gflops": min(peak, intensity * bandwidth),
        "achieved_gflops": cost.flops / seconds / 1e9,
        "achieved_gbs": cost.bytes / seconds / 1e9,
        "roofline_seconds": roof_s,
        "fraction": roof_s / seconds,
        "bound": "compute" if compute_s >= memory_s and cost.flops else "memory",
    }
