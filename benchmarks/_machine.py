"""The `machine` record every benchmark's result carries: this CPU as `kiln doctor` reads it,
its class (the name results are filed under), its cached peaks, and how busy the host was."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

from kiln.hardware import cpu_info

# Other processes keeping more than this share of one core busy make the host "shared":
# their work competes with the timed runs for cores, caches and memory bandwidth.
SHARED_BUSY_CORES = 0.2


def machine() -> dict[str, Any]:
    cpu = cpu_info()
    return {
        "cpu": cpu.model,
        "cpu_class": cpu.cpu_class,
        "cores": cpu.logical_cores,
        "features": cpu.features,
        "platform": platform.platform(),
        "peaks": cached_peaks(),
        "host": host_load(),
    }


def cached_peaks() -> dict[str, Any] | None:
    """`kiln doctor`'s measured peaks when this machine has them cached (None otherwise:
    measuring them takes a minute and would disturb the benchmark)."""
    from kiln.hardware.peaks import _load, cache_path

    peaks = _load(cache_path())
    if peaks is None:
        return None
    keep = ("fp32_gflops", "bf16_gflops", "int8_gops", "bandwidth_gbs", "threads", "measured_at")
    return {key: getattr(peaks, key) for key in keep}


def host_load(window_s: float = 0.5) -> dict[str, Any]:
    """How busy the host is now: the load averages, and the cores other processes kept busy
    over `window_s` (this process sleeps meanwhile, so what is busy is someone else's)."""
    try:
        load = list(os.getloadavg())
    except OSError:
        load = None
    start = _busy_seconds()
    time.sleep(window_s)
    end = _busy_seconds()
    busy = None if start is None or end is None else round((end - start) / window_s, 3)
    return {
        "load_average": load,
        "other_busy_cores": busy,
        "shared": busy is not None and busy > SHARED_BUSY_CORES,
    }


def _busy_seconds() -> float | None:
    """Every core's busy seconds since boot (all but idle and iowait; steal counts as busy)."""
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
