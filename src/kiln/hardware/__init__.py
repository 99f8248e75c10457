"""What machine this is: CPU model, ISA features that matter to engines, cores, and the
practical peaks (GFLOP/s per precision, memory bandwidth) measured on it and cached on disk."""

from kiln.hardware.cpu import INTERESTING_FLAGS, CpuInfo, cpu_info
from kiln.hardware.peaks import Peaks, measured_peaks

__all__ = ["INTERESTING_FLAGS", "CpuInfo", "Peaks", "cpu_info", "measured_peaks"]
