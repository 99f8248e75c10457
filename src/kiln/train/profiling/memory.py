"""The memory of the profiled steps over time, by category (parameters, gradients, optimizer
state, activations, other), its peak and what it held there: torch's memory profiler, or the
allocator's running total where that private API fails."""

from __future__ import annotations

import math
from typing import Any

import torch

from kiln.train.profiling.record import CATEGORIES

MIB = 1 << 20
MAX_POINTS = 1500  # of the memory timeline kept for the report (the peak always among them)

# torch's categories → the report's (inputs, temporaries and autograd's own buffers are "other")
_TORCH_CATEGORIES = {
    "PARAMETER": "parameters",
    "GRADIENT": "gradients",
    "OPTIMIZER_STATE": "optimizer state",
    "ACTIVATION": "activations",
}


def memory_timeline(
    prof: Any, device: torch.device, origin: float, marks: list[float]
) -> dict[str, Any]:
    """The memory timeline by category (ms from the first profiled step, MiB), its peak and
    what it held at the peak. torch's categorisation is a private API: on any failure the
    allocator's running total (uncategorised) stands in, and the note says why."""
    try:
        times, columns = _categorised(prof, device)
        source, note = "categories", None
    except Exception as exc:  # noqa: BLE001 - a private API's failure must not lose the profile
        times, columns = _allocated(prof, device)
        source = "allocator"
        note = (f"memory categories unavailable ({type(exc).__name__}: {exc}); allocations made "
                "while profiling, uncategorised")  # fmt: skip
    return _timeline(times, columns, origin, marks) | {
        "source": source, "device": str(device), "note": note, "device_mib": _device_mib(device),
    }  # fmt: skip


def _device_mib(device: torch.device) -> float:
    """All the memory of the device: the GPU's, or the machine's for a CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / MIB
    import psutil

    return psutil.virtual_memory().total / MIB


def _categorised(prof: Any, device: torch.device) -> tuple[list[float], dict[str, list[float]]]:
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX, MemoryProfileTimeline

    times, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(str(device))
    if not times:
        raise ValueError(f"no allocations on {device}")
    columns: dict[str, list[float]] = {name: [0.0] * len(times) for name in CATEGORIES}
    for category, index in _CATEGORY_TO_INDEX.items():
        name = _TORCH_CATEGORIES.get(getattr(category, "name", ""), "other")
        column = columns[name]
        for row, values in enumerate(sizes):
            column[row] += values[index + 1] / MIB  # slot 0 of each row is unused
    return [float(t) for t in times], columns


def _allocated(prof: Any, device: torch.device) -> tuple[list[float], dict[str, list[float]]]:
    cpu = device.type == "cpu"
    records = sorted(
        (e.start_ns() / 1e3, e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and (e.device_type() == torch.autograd.DeviceType.CPU) == cpu
    )
    total, times, column = 0.0, [], []
    for at, change in records:
        total += change / MIB
        times.append(at)
        column.append(total)
    return times, {name: column if name == "other" else [0.0] * len(column) for name in CATEGORIES}


def _timeline(
    times: list[float], columns: dict[str, list[float]], origin: float, marks: list[float]
) -> dict[str, Any]:
    totals = [sum(columns[name][i] for name in CATEGORIES) for i in range(len(times))]
    if not totals:
        return {"t_ms": [], "mib": {}, "peak_mib": 0.0, "peak_t_ms": None, "at_peak_mib": {},
                "steps_ms": []}  # fmt: skip
    peak = max(range(len(totals)), key=totals.__getitem__)
    keep = _thin(totals, MAX_POINTS)
    return {
        "t_ms": [(times[i] - origin) / 1e3 for i in keep],
        "mib": {name: [columns[name][i] for i in keep] for name in CATEGORIES},
        "peak_mib": totals[peak],
        "peak_t_ms": (times[peak] - origin) / 1e3,
        "at_peak_mib": {name: columns[name][peak] for name in CATEGORIES},
        "steps_ms": [(mark - origin) / 1e3 for mark in marks],
    }


def _thin(totals: list[float], most: int) -> list[int]:
    """Indices of at most ~`most` points: the highest of each run of neighbours, so the
    peaks survive the thinning."""
    if len(totals) <= most:
        return list(range(len(totals)))
    size = math.ceil(len(totals) / most)
    return [max(range(i, min(i + size, len(totals))), key=totals.__getitem__)
            for i in range(0, len(totals), size)]  # fmt: skip
