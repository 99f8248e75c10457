"""Whether a stage's calls from several streams should share a run: measured per stage.

Pooling the calls streams make at once into one batch pays where the engine runs a batch
faster per sample than its samples apart (a small classifier, whose per-call cost dominates).
It does not where one call already fills the cores: a detector's 736×3456 image runs as long
per image in a batch of two, and the batch holds both streams until the slower is done, so
merging only lengthens queries and delays the stage's other work (benchmarks/pipeline_ocr.py:
RapidOCR's detector with its calls merged answered fewer queries per second at 16 streams than
with the same calls run apart).

Guarantee: a stage's calls are merged at run time (`kiln.Pipeline`, streams.py) only where its
chosen artifact, on a recorded call of median time with its feeds doubled along the batch axis,
ran faster per sample than the call run twice — every round of kiln.timing's interleaved
timing saying so. A model that takes no batch of two, or whose timing shows no gain beyond
noise, has its calls run one each (several at once, side by side).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from kiln.errors import KilnError
from kiln.pipeline.recording import Call, Recording
from kiln.timing import FASTER, Speedup, interleave, speedup

Say = Callable[[str], None]
Measure = Callable[[Callable[[], object], Callable[[], object]], Speedup]


def measure_merging(apart: Callable[[], object], merged: Callable[[], object]) -> Speedup:
    """Two calls run one after the other against the same two as one batch, interleaved."""
    samples = interleave({"apart": apart, "merged": merged}, rounds=3, runs=3, warmup=1)
    return speedup(samples["apart"], samples["merged"])


def decide_merging(
    stages: Mapping[str, Any], reference: Recording, say: Say, measure: Measure | None = None
) -> dict[str, dict[str, Any]]:
    """Per stage: whether its calls merge across streams (`merge`), with the measured speedup
    of a batch of two per sample and the reason."""
    out = {}
    for name, stage in stages.items():
        calls = reference.of(name)
        if not calls:
            out[name] = {"merge": False, "reason": "not called in the reference run"}
            continue
        say(f"  {name}: timing a batch of two of its calls against the two apart ...")
        out[name] = _stage(str(stage.candidates[stage.choice]), calls, measure or measure_merging)
        say(f"  {name}: {'calls merged' if out[name]['merge'] else 'calls run apart'}: "
            f"{out[name]['reason']}")  # fmt: skip
    return out


def _stage(artifact: str, calls: list[Call], measure: Measure) -> dict[str, Any]:
    from kiln.runtime import Session

    call = sorted(calls, key=lambda c: c.seconds)[len(calls) // 2]
    doubled = {name: np.concatenate([value, value]) for name, value in call.feeds.items()
               if np.ndim(value) > 0}  # fmt: skip
    if len(doubled) < len(call.feeds):
        return {"merge": False, "reason": "an input has no batch axis"}
    with Session(artifact) as session:
        try:
            session.run(None, doubled)
        except KilnError:  # its message names the compile's temporary copy: not kept
            return {"merge": False, "reason": "the model takes no batch of two"}
        result = measure(
            lambda: (session.run(None, call.feeds), session.run(None, call.feeds)),
            lambda: session.run(None, doubled),
        )
    record = {"speedup": round(result.value, 3), "verdict": result.verdict}
    if result.verdict != FASTER:
        why = f"a batch of two is not faster per sample ({result.value:.2f}x, {result.verdict})"
        return record | {"merge": False, "reason": why}
    return record | {"merge": True, "reason": f"a batch of two is {result.value:.2f}x faster "
                                              "per sample"}  # fmt: skip
