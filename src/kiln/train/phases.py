"""The phases of a training step, marked for the step profiler (kiln.train.profiling).

The loop wraps each part of a step in `phase(name)`: a `torch.profiler.record_function`
labelled `kiln.NAME`, which costs next to nothing when no profiler runs. While the step
profiler times steps without the profiler (`recording`), each phase also notes its own
wall-clock span, so the split of a step is measured at full speed, not under the profiler's
overhead.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from kiln.errors import KilnError

PHASES = ("data", "forward", "backward", "optimizer")


@dataclass
class Recording:
    """Wall-clock spans (phase, start s, end s) of the outermost phases while recording.
    `sync` waits for the device at each phase boundary (GPU work is asynchronous: without it
    a phase would end when its kernels are launched, not done)."""

    sync: Callable[[], None] | None = None
    spans: list[tuple[str, float, float]] = field(default_factory=list)
    depth: int = 0  # phases open now: a phase inside another counts as its parent's


_active: Recording | None = None  # one recording at a time: the profiler's own steps


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Mark the code inside as phase `name` (one of PHASES) of the current step."""
    if name not in PHASES:
        raise KilnError(f"phase '{name}': use one of {', '.join(PHASES)}.")
    recording = _active
    with torch.profiler.record_function(f"kiln.{name}"):
        if recording is None:
            yield
            return
        with _span(recording, name):
            yield


@contextmanager
def _span(recording: Recording, name: str) -> Iterator[None]:
    outermost = recording.depth == 0
    recording.depth += 1
    if outermost and recording.sync is not None:
        recording.sync()
    start = time.perf_counter()
    try:
        yield
    finally:
        if outermost and recording.sync is not None:
            recording.sync()
        recording.depth -= 1
        if outermost:
            recording.spans.append((name, start, time.perf_counter()))


@contextmanager
def recording(sync: Callable[[], None] | None = None) -> Iterator[Recording]:
    """Note the span of every phase run inside (the step profiler's timed steps)."""
    global _active
    if _active is not None:
        raise KilnError("the step profiler is already recording phases: one at a time.")
    _active = Recording(sync)
    try:
        yield _active
    finally:
        _active = None
