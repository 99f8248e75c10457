"""When the adaptive runtime rebuilds its bucket set: the triggers, judged on the traffic
since the last swap (the load monitor's window)."""

from __future__ import annotations

import enum
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


class TriggerKind(enum.Enum):
    """Why a bucket set is rebuilt."""

    MISSES = "misses"  # a frequent shape no bucket holds
    WASTE = "waste"  # padding waste above the policy's threshold
    P99_DRIFT = "p99 drift"  # a bucket slower than its post-swap baseline: rebuilt afresh
    MANUAL = "manual"  # `Session.swap()` (or the server's swap endpoint)


@dataclass(frozen=True)
class Trigger:
    """A reason to rebuild: its kind for the code to branch on, its detail for people (what
    stats() and the decisions record, via str())."""

    kind: TriggerKind
    detail: str

    def __str__(self) -> str:
        return self.detail


def find_trigger(
    window: list[Observation], policy: AdaptivePolicy, baseline: dict[str, float]
) -> Trigger | None:
    """Why the bucket set should change, or None: a frequent shape no bucket holds, padding
    waste above the threshold, or a bucket's P99 drifting above its baseline (the first P99
    seen for it since the last swap, recorded into `baseline`)."""
    return (
        _frequent_miss(window, policy)
        or _too_much_waste(window, policy)
        or _p99_drift(window, policy, baseline)
    )


def _frequent_miss(window: list[Observation], policy: AdaptivePolicy) -> Trigger | None:
    misses: dict[str, int] = {}
    for o in window:
        if o.bucket == "dynamic":
            text = bk.key_text(bk.key_of(o.dims))
            misses[text] = misses.get(text, 0) + 1
    if not misses:
        return None
    shape, count = max(misses.items(), key=lambda kv: kv[1])
    if count < policy.miss_share * len(window):
        return None
    detail = f"frequent shape {shape} has no bucket ({count} of {len(window)} runs)"
    return Trigger(TriggerKind.MISSES, detail)


def _too_much_waste(window: list[Observation], policy: AdaptivePolicy) -> Trigger | None:
    waste = waste_of(window)
    if waste <= policy.waste:
        return None
    return Trigger(TriggerKind.WASTE, f"padding waste {waste:.0%} > {policy.waste:.0%}")


def _p99_drift(
    window: list[Observation], policy: AdaptivePolicy, baseline: dict[str, float]
) -> Trigger | None:
    per_bucket: dict[str, list[float]] = {}
    for o in window:
        per_bucket.setdefault(o.bucket, []).append(o.seconds)
    for bucket, times in per_bucket.items():
        if len(times) < policy.min_samples:
            continue
        # The latest runs only: a drift shows there first.
        p99 = float(np.percentile(times[-policy.min_samples :], 99))
        base = baseline.setdefault(bucket, p99)
        if p99 > policy.p99_drift * base:
            detail = f"P99 drift on {bucket}: {p99 * 1e3:.2f} ms vs {base * 1e3:.2f} ms"
            return Trigger(TriggerKind.P99_DRIFT, detail)
    return None
