"""When the adaptive runtime rebuilds its bucket set: the triggers, judged on the traffic
since the last swap (the load monitor's window)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.runtime import buckets as bk
from kiln.runtime.monitor import Observation, waste_of


@dataclass
class AdaptivePolicy:
    """When the adaptive runtime rebuilds its buckets. Judged on the traffic since the last
    swap, at most every `interval_s`, and never twice within `cooldown_s`."""

    min_samples: int = 50  # runs in the window before any judgement
    miss_share: float = 0.1  # one missed shape this frequent -> rebuild
    waste: float = 0.35  # padding waste (fraction of elements) above this -> rebuild
    p99_drift: float = 3.0  # a bucket's P99 this many times its post-swap baseline -> rebuild
    interval_s: float = 1.0
    cooldown_s: float = 60.0  # a rebuild warms and verifies every bucket: not for free
    sizes_per_dim: int = 4


def find_trigger(
    window: list[Observation], policy: AdaptivePolicy, baseline: dict[str, float]
) -> str | None:
    """Why the bucket set should change, or None: a frequent shape no bucket holds, padding
    waste above the threshold, or a bucket's P99 drifting above its baseline (the first P99
    seen for it since the last swap, recorded into `baseline`)."""
    misses: dict[str, int] = {}
    for o in window:
        if o.bucket == "dynamic":
            text = bk.key_text(bk.key_of(o.dims))
            misses[text] = misses.get(text, 0) + 1
    if misses:
        shape, count = max(misses.items(), key=lambda kv: kv[1])
        if count >= policy.miss_share * len(window):
            return f"frequent shape {shape} has no bucket ({count} of {len(window)} runs)"
    waste = waste_of(window)
    if waste > policy.waste:
        return f"padding waste {waste:.0%} > {policy.waste:.0%}"
    per_bucket: dict[str, list[float]] = {}
    for o in window:
        per_bucket.setdefault(o.bucket, []).append(o.seconds)
    for bucket, times in per_bucket.items():
        if len(times) < policy.min_samples:
            continue
        p99 = float(np.percentile(times[-policy.min_samples :], 99))
        base = baseline.setdefault(bucket, p99)
        if p99 > policy.p99_drift * base:
            return f"P99 drift on {bucket}: {p99 * 1e3:.2f} ms vs {base * 1e3:.2f} ms"
    return None
