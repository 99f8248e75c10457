"""What machine this is: CPU model, ISA features that matter to engines, cores, and the
practical peaks (GFLOP/s per precision, memory bandwidth) measured on it and cached on disk,
and its jitter floor (the tail of fixed work here, now; measured, never cached)."""

from kiln.hardware.cpu import INTERESTING_FLAGS, CpuInfo, cpu_info
from kiln.hardware.jitter import FloorSampler, JitterFloor, jitter_floor
from kiln.hardware.peaks import Peaks, measured_peaks

__all__ = [
    "INTERESTING_FLAGS",
    "CpuInfo",
    "FloorSampler",
    "JitterFloor",
    "Peaks",
    "cpu_info",
    "jitter_floor",
    "measured_peaks",
]
