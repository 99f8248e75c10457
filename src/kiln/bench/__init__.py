"""Honest side-by-side latency: engines interleaved in one process, ratios of medians with
their spread and a verdict."""

from kiln.timing import LatencyStats, Speedup, interleave, round_stats, speedup, speedups, stats

__all__ = ["LatencyStats", "Speedup", "interleave", "round_stats", "speedup", "speedups", "stats"]
