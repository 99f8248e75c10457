"""Process memory over time: a background thread samples RSS while the model runs."""

from __future__ import annotations

import threading
import time

import psutil

INTERVAL_S = 0.01


class RssSampler:
    """Samples this process's resident set size every INTERVAL_S seconds.

    `mark(label)` records where a phase (compile, warm-up, timing, profiling) begins, so the
    memory chart can show which work grew the memory.
    """

    def __init__(self) -> None:
        self._process = psutil.Process()
        self._start = time.perf_counter()
        self.samples: list[tuple[float, float]] = []  # (seconds since start, MiB)
        self.marks: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> RssSampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def now_mib(self) -> float:
        return self._process.memory_info().rss / 2**20

    def mark(self, label: str) -> float:
        """Note the start of a phase; returns RSS in MiB at that moment."""
        rss = self._sample()
        self.marks.append((time.perf_counter() - self._start, label))
        return rss

    def peak_mib(self) -> float:
        """The highest RSS sampled so far."""
        return max(m for _, m in list(self.samples))

    def _sample(self) -> float:
        rss = self.now_mib()
        self.samples.append((time.perf_counter() - self._start, rss))
        return rss

    def _loop(self) -> None:
        while not self._stop.wait(INTERVAL_S):
            self._sample()

    def to_json(self) -> dict:
        # Both threads append, so restore time order first.
        samples = sorted(self.samples)
        return {
            "interval_s": INTERVAL_S,
            "t_s": [round(t, 4) for t, _ in samples],
            "rss_mib": [round(m, 2) for _, m in samples],
            "marks": [{"t_s": round(t, 4), "label": label} for t, label in self.marks],
            "peak_mib": max(m for _, m in samples),
        }
