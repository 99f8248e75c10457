"""The load monitor: what ran where, how fast, how much of it was padding, and every decision
the runtime took. Thread-safe. Recording is on every request's path, so it is one append to a
queue (atomic in CPython: no lock); the figures are folded from that queue by whoever reads
them next; once FOLD_EVERY records wait, each new one folds FOLD_STEP of them, so the queue
stays bounded when no one reads and no request pays for folding 64 at once (~70 µs every 64th
request: a tiny model's P99). Other
threads (tests, scripts) can wait on it for a swap or a decision instead of sleeping."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

import numpy as np

log = logging.getLogger("kiln.runtime")

LATENCY_SAMPLES = 1000  # per bucket: enough for a stable P99, bounded memory
FOLD_EVERY = 64  # records queued before the recording thread folds some itself
FOLD_STEP = 2  # folded per record past FOLD_EVERY: more than come in, so the queue drains


@dataclass(slots=True)
class Observation:
    dims: dict[str, int]
    bucket: str  # key text, or "dynamic" for a miss
    seconds: float
    real: int  # input elements the requests brought
    executed: int  # input elements actually run (with padding)


@dataclass
class _BucketStats:
    runs: int = 0
    requests: int = 0
    real: int = 0
    executed: int = 0
    latencies: deque = field(default_factory=lambda: deque(maxlen=LATENCY_SAMPLES))


class LoadMonitor:
    def __init__(self, window: int = 2000) -> None:
        # Re-entrant, so that a predicate given to wait_until may read anything here.
        self._lock = threading.RLock()
        # Notified on every decision, swap and adaptive check: what waiters wait for.
        self._changed = threading.Condition(self._lock)
        self._buckets: dict[str, _BucketStats] = {}
        self.hits = self.misses = 0
        self.missed_shapes: Counter[str] = Counter()
        # Recent traffic only: the adaptive policy judges the current bucket set on it.
        self._window: deque[Observation] = deque(maxlen=window)
        self.observed = 0  # observations ever recorded: a cursor that outlives the window
        self.compiles = 0  # bucket executables built (lazily, at warm-up or for a swap)
        self.evictions = 0  # least recently used executables dropped (memory cap)
        self.recompiles = self.swaps = 0  # bucket-set rebuilds started; swaps completed
        self.checks = 0  # adaptive judgements of a full window (whatever they concluded)
        self.decisions: list[dict[str, Any]] = []
        self._queued: deque[tuple[Observation, int]] = deque()  # recorded, not yet folded
        self._texts: dict[tuple, str] = {}

    def record(self, obs: Observation, requests: int) -> None:
        """On the request path: one append; see the module docstring."""
        self._queued.append((obs, requests))
        if len(self._queued) >= FOLD_EVERY:
            self._fold(FOLD_STEP)

    def _fold(self, limit: int | None = None) -> None:
        """Fold the queued records (at most `limit` of them) into the figures."""
        with self._lock:
            count = len(self._queued) if limit is None else min(limit, len(self._queued))
            for _ in range(count):
                self._add(*self._queued.popleft())

    def _add(self, obs: Observation, requests: int) -> None:
        """Fold one record into the figures (under the lock)."""
        stats = self._buckets.get(obs.bucket)
        if stats is None:  # not setdefault: it would build a _BucketStats every time
            stats = self._buckets[obs.bucket] = _BucketStats()
        stats.runs += 1
        stats.requests += requests
        stats.real += obs.real
        stats.executed += obs.executed
        stats.latencies.append(obs.seconds)
        if obs.bucket == "dynamic":
            self.misses += requests
            self.missed_shapes[self._shape_text(obs.dims)] += requests
        else:
            self.hits += requests
        self._window.append(obs)
        self.observed += 1

    def _shape_text(self, dims: dict[str, int]) -> str:
        """ "batch=1,seq=8", built once per shape (requests of one shape share their dims)."""
        key = tuple(dims.items())
        text = self._texts.get(key)
        if text is None:
            if len(self._texts) >= 4096:  # bounded, whatever the traffic
                self._texts.clear()
            text = self._texts[key] = _shape_text(dims)
        return text

    def decide(self, trigger: object, action: str) -> None:
        """Record a decision; `trigger` is a Trigger or plain text, kept as text."""
        log.info("kiln.runtime: %s -> %s", trigger, action)
        with self._changed:
            self.decisions.append({"time": time.time(), "trigger": str(trigger), "action": action})
            self._changed.notify_all()

    def swapped(self) -> None:
        with self._changed:
            self.swaps += 1
            self._changed.notify_all()

    def checked(self) -> None:
        with self._changed:
            self.checks += 1
            self._changed.notify_all()

    def wait_until(self, condition: Callable[[LoadMonitor], bool], timeout: float) -> bool:
        """Block until `condition(self)` holds (re-tested on every decision, swap and check);
        False if `timeout` seconds pass first."""
        with self._changed:
            return self._changed.wait_for(lambda: condition(self), timeout)

    def window(self) -> list[Observation]:
        with self._lock:
            self._fold()
            return list(self._window)

    def since(self, cursor: int) -> tuple[list[Observation], int]:
        """The observations recorded after `cursor` (a past `observed`) that the bounded
        window still holds, and the cursor to pass next time. A reader that compared window
        lengths would go blind once the window is full and stays the same length."""
        with self._lock:
            self._fold()
            fresh = min(max(self.observed - cursor, 0), len(self._window))
            # The newest `fresh` only, read from the right end: copying the whole window
            # (2,000 records) cost 10–17 µs on every batch a server runs.
            recent = list(islice(reversed(self._window), fresh))
            recent.reverse()
            return recent, self.observed

    def reset_window(self) -> None:
        with self._lock:
            self._fold()
            self._window.clear()

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            self._fold()
            buckets = {
                key: {
                    "runs": s.runs,
                    "requests": s.requests,
                    "padding_waste": _waste(s.real, s.executed),
                    "p50_ms": percentile_ms(s.latencies, 50),
                    "p99_ms": percentile_ms(s.latencies, 99),
                }
                for key, s in self._buckets.items()
            }
            real = sum(s.real for s in self._buckets.values())
            executed = sum(s.executed for s in self._buckets.values())
            return {
                "requests": self.hits + self.misses,
                "hits": self.hits,
                "misses": self.misses,
                "missed_shapes": dict(self.missed_shapes),
                "padding_waste": _waste(real, executed),
                "buckets": buckets,
                "compiles": self.compiles,
                "evictions": self.evictions,
                "recompiles": self.recompiles,
                "swaps": self.swaps,
                "adaptive_checks": self.checks,
                "decisions": list(self.decisions),
            }


def _shape_text(dims: dict[str, int]) -> str:
    return ",".join(f"{d}={v}" for d, v in sorted(dims.items()))


def _waste(real: int, executed: int) -> float:
    return 0.0 if executed == 0 else 1.0 - real / executed


def percentile_ms(latencies: deque, q: float) -> float:
    """The q-th percentile of latencies in seconds, in ms (0.0 for none)."""
    return float(np.percentile(latencies, q) * 1e3) if latencies else 0.0


def waste_of(window: list[Observation]) -> float:
    return _waste(sum(o.real for o in window), sum(o.executed for o in window))
