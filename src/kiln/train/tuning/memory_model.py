"""The memory model the training tuner skips configs by: peaks measured so far predict the
next one (a + b·micro_batch per precision, checkpointing and ranks)."""

from __future__ import annotations

import statistics
from typing import Any

from kiln.train.config import TrainConfig

PREDICT_MARGIN = 1.2  # skip a config predicted above this × --max-memory (the model is rough)


def group_of(config: TrainConfig) -> tuple[str, str, int]:
    """What shifts the peak besides the micro-batch: precision, checkpointing, ranks (each
    rank a process with its own copy of the runtime)."""
    return (config.precision, config.checkpointing.policy, config.parallel.ranks)


Point = tuple[Any, int, float]  # (group_of(config), micro_batch, measured peak MiB)


def predict_peak(points: list[Point], group: Any, micro_batch: int) -> float | None:
    """The peak (MiB) `points` — (group, micro_batch, measured peak) of trials so far — predict
    for `micro_batch` in `group`: a least-squares a + b·micro_batch (b ≥ 0: more samples never
    need less memory) where two micro-batches were measured, and never below a measured peak
    of a smaller or equal micro-batch. None where the group has no point."""
    mine = [(m, peak) for g, m, peak in points if g == group]
    if not mine:
        return None
    floor = max((peak for m, peak in mine if m <= micro_batch), default=0.0)
    xs = [m for m, _ in mine]
    if len(set(xs)) < 2:
        return floor or None
    mean_x, mean_y = statistics.mean(xs), statistics.mean(p for _, p in mine)
    slope = sum((m - mean_x) * (p - mean_y) for m, p in mine) / sum((m - mean_x) ** 2 for m in xs)
    slope = max(0.0, slope)
    return max(floor, mean_y + slope * (micro_batch - mean_x))


def predicted_over(points: list[Point], config: TrainConfig, cap_mib: float | None) -> str | None:
    """Why `config` is not worth a run under `cap_mib` (None: run it): predicted above
    PREDICT_MARGIN × the cap by the trials measured so far."""
    if cap_mib is None:
        return None
    predicted = predict_peak(points, group_of(config), config.micro_batch)
    if predicted is None or predicted <= PREDICT_MARGIN * cap_mib:
        return None
    return (f"skipped: predicted to peak at {over_limit(predicted, PREDICT_MARGIN * cap_mib)} "
            f"({PREDICT_MARGIN:g} × the limit) from the trials measured so far")  # fmt: skip


def over_limit(peak_mib: float, cap_mib: float) -> str:
    """`PEAK MiB > CAP MiB`, both at the fewest decimals that show the peak above the cap
    (415.04 over 415 is "415.04 MiB > 415.00 MiB", never "415.0 MiB > 415 MiB")."""
    for decimals in range(4):
        peak, cap = f"{peak_mib:.{decimals}f}", f"{cap_mib:.{decimals}f}"
        if float(peak) > float(cap):
            return f"{peak} MiB > {cap} MiB"
    return f"{peak_mib:.6f} MiB > {cap_mib:.6f} MiB"
