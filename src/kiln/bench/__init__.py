"""Honest side-by-side latency: engines interleaved in one process, ratios of medians with
their spread and a verdict. `config` holds `BenchConfig`, what one `kiln bench` run measures.

The timing names load on first use, so `kiln --help` (which reads BenchConfig) does not pay
for numpy.
"""

from typing import Any

__all__ = ["LatencyStats", "Speedup", "interleave", "round_stats", "speedup", "speedups", "stats"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'kiln.bench' has no attribute '{name}'")
    import kiln.timing

    return getattr(kiln.timing, name)
