"""The pass stage of a compile: run the pipeline on a copy, verify, and when the outputs
break, bisect to the guilty pass, drop it and run again.

Guarantee: the returned model verified (or verification was off, or every pass was dropped and
it still fails — the caller refuses to write it); every dropped pass is named.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir

from kiln.backends import get_backend
from kiln.backends.release import collect_garbage
from kiln.compiler.reference import Feeds, copy_model
from kiln.errors import KilnError
from kiln.ir.weights import weight_bytes
from kiln.passes import PassCrashed, PassReport, PassSpec, default_pipeline, run_pipeline
from kiln.passes.unfused_blocks import unfused_notes
from kiln.verify import Budget, Verification, compare

Say = Callable[[str], None]

# A model with fewer weight bytes leaves too little behind in a discarded trial to be worth a
# full collector pass before the next (tens of milliseconds, hundreds of trials in a test run).
COLLECT_ABOVE_BYTES = 64 << 20


@dataclass
class Target:
    """What a candidate is verified on and against."""

    engine: str
    options: Any
    precision: str
    feeds: list[Feeds]
    reference: list[list[np.ndarray]]
    source: str  # where the feeds came from
    noise: dict[str, float] = field(default_factory=dict)
    budget: Budget = field(default_factory=Budget)
    verify: bool = True


@dataclass
class Built:
    model: ir.Model
    reports: list[PassReport]
    verification: Verification | None
    dropped: list[str]
    executable: Any = None  # the verified executable, when verification ran
    notes: list[str] = field(default_factory=list)  # blocks the fusions left, and why


def verify_on(model: ir.Model, target: Target) -> tuple[Verification, Any]:
    """Compile `model` for the target's engine and compare it with the reference."""
    names = [v.name for v in model.graph.outputs]
    if weight_bytes(model) > COLLECT_ABOVE_BYTES:
        collect_garbage()  # the trial before this one, its model and its engine's session
    try:
        exe = get_backend(target.engine).compile(model, target.options)
        outputs = [exe.run(f) for f in target.feeds]
    except KilnError as exc:
        return Verification(False, target.precision, target.source, [], error=str(exc)), None
    verification = compare(
        names, target.reference, outputs, target.source, target.precision,
        noise=target.noise, budget=target.budget,
    )  # fmt: skip
    return verification, exe


def run_passes(original: ir.Model, pipeline: list[PassSpec], target: Target, say: Say) -> Built:
    """Run `pipeline` on a copy of `original` and verify it; a pass that crashes or breaks
    the outputs is dropped (by its position: a name may appear several times) and the rest run
    again. A pipeline that does not end in cleanup gets one appended (a tidy-up); if that
    tidy-up is what fails, it is dropped the same way."""
    tidy = _cleanup()

    def attempt(specs: list[PassSpec], tidy_up: bool = True) -> Built:
        model = copy_model(original)
        if tidy_up and tidy is not None and specs and specs[-1].name != tidy.name:
            # A prefix may stop between fusions that leave helper functions behind.
            specs = [*specs, tidy]
        reports = run_pipeline(model, specs, on_step=lambda s: say(f"pass {s.name}"))
        if not target.verify:
            return Built(model, reports, None, [])
        say("verifying against the original")
        verification, exe = verify_on(model, target)
        return Built(model, reports, verification, [], exe)

    dropped: list[str] = []
    active = list(pipeline)
    while True:
        try:
            built = attempt(active)
        except PassCrashed as crash:
            guilty = _position(active, crash, tidied=tidy is not None)
            say(f"{crash}; dropped it")
        else:
            if built.verification is None or built.verification.ok or not active:
                break
            if target.precision != "fp32":
                break  # lower precision drifts by itself: no pass is to blame
            guilty = _bisect(active, attempt, say, tidied=tidy is not None)
            name = active[guilty].name if guilty is not None else tidy.name
            say(f"pass {name} broke the outputs; dropped it")
        if guilty is None:  # the appended tidy-up: no longer append it, nor run it at all
            if tidy.name not in dropped:  # already named when its own entry was dropped
                dropped.append(tidy.name)
            active = [s for s in active if s.name != tidy.name]
            tidy = None
        else:
            dropped.append(active[guilty].name)
            del active[guilty]
    built.dropped = dropped
    if any(s.stage == "fuse" and s.engines is not None for s in active):
        # Only where the engine-specific fusions ran is a leftover block news.
        built.notes = unfused_notes(built.model)
    return built


def _cleanup() -> PassSpec | None:
    return next((s for s in default_pipeline() if s.name == "cleanup"), None)


def _position(pipeline: list[PassSpec], crash: PassCrashed, tidied: bool) -> int | None:
    """Where in `pipeline` the crashed pass stands; None for the tidy-up appended after it
    (only when `tidied`: one was appended). Never fails: some entry is always to blame."""
    if crash.index is not None and crash.index < len(pipeline):
        return crash.index
    if crash.index is None:
        # Raised without a position: the last entry that is this very spec, else the last of
        # that name.
        for match in (lambda s: s is crash.spec, lambda s: s.name == crash.spec.name):
            found = [i for i, s in enumerate(pipeline) if match(s)]
            if found:
                return found[-1]
    return None if tidied or not pipeline else len(pipeline) - 1


def _bisect(
    pipeline: list[PassSpec], attempt: Callable[..., Built], say: Say, tidied: bool
) -> int | None:
    """Smallest failing prefix: the position of the pass that ends it, or None when that
    prefix verifies without the tidy-up appended to it (then the tidy-up is to blame)."""
    low, high = 0, len(pipeline)  # prefix of `low` passes verifies; of `high` fails
    while high - low > 1:
        middle = (low + high) // 2
        say(f"bisecting: trying the first {middle} passes")
        if _fails(attempt, pipeline[:middle]):
            high = middle
        else:
            low = middle
    prefix = pipeline[:high]
    appended = tidied and (high < len(pipeline) or prefix[-1].name != "cleanup")
    if appended and not _fails(attempt, prefix, tidy_up=False):
        return None
    return high - 1


def _fails(attempt: Callable[..., Built], specs: list[PassSpec], **options: bool) -> bool:
    try:
        verification = attempt(specs, **options).verification
    except PassCrashed:
        return True  # a prefix that cannot even run is a failing prefix
    return verification is not None and not verification.ok
