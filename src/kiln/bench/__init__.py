"""Honest side-by-side latency: engines interleaved in one process, ratios of medians."""

from kiln.timing import LatencyStats, interleave, round_ratios, stats

__all__ = ["LatencyStats", "interleave", "round_ratios", "stats"]
