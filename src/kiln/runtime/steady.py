"""Steady by construction: what a session pays once, when it opens, so that no request pays it.

- A warm-up run at the largest shape the session expects (its largest bucket, else the
  model's synthesized inputs): the engine's arena grows to that size, its buffers' pages are
  touched and its lazily built kernels are built before the first request instead of during
  it.
- `gc.freeze()` after the warm-up: the objects alive then (the engines' and Kiln's imports,
  the model's interface, the warm-up's leftovers) move out of the collector's generations,
  so a request that triggers a collection never pays for walking them (gc.freeze after
  warm-up cut an LLM server's P99 by 18 %). Once per process while any steady session is
  open: a frozen object that later becomes cyclic garbage is never collected, so freezing
  again with every session would keep every dropped session alive; the last steady session
  to close unfreezes (`release_gc`), and everything is collectable again.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Mapping

import numpy as np
import onnx_ir as ir

from kiln.ir.inputs import synthesize

_lock = threading.Lock()
_holders = 0  # open steady sessions; the heap is frozen while there is one


def freeze_gc() -> None:
    """Hold the process's GC freeze: the first holder collects (so no garbage is frozen for
    good) and freezes; later ones only count."""
    global _holders
    with _lock:
        if _holders == 0:
            gc.collect()
            gc.freeze()
        _holders += 1


def release_gc() -> None:
    """Give a hold back; the last one unfreezes, so that what was frozen can be collected
    once it is garbage (a closed session among it)."""
    global _holders
    with _lock:
        if _holders == 0:
            return
        _holders -= 1
        if _holders == 0:
            gc.unfreeze()


def largest_dims(buckets: Mapping[str, list[int]]) -> dict[str, int]:
    """Each bucketed dim at its largest size: the shape whose arena holds every bucket's."""
    return {dim: max(sizes) for dim, sizes in buckets.items() if sizes}


def warm_up(
    interface: ir.Model,
    buckets: Mapping[str, list[int]],
    run: Callable[[dict[str, np.ndarray]], object],
) -> None:
    """One run of `run` on synthesized inputs at the largest bucket's shape (the model's
    default dims where there are no buckets)."""
    run(synthesize(interface, dims=largest_dims(buckets)))
