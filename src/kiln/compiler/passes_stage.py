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
from kiln.compiler.reference import Feeds, copy_model
from kiln.errors import KilnError
from kiln.passes import PassCrashed, PassReport, PassSpec, default_pipeline, run_pipeline
from kiln.verify import Budget, Verification, compare

Say = Callable[[str], None]


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


def verify_on(model: ir.Model, target: Target) -> tuple[Verification, Any]:
    """Compile `model` for the target's engine and compare it with the reference."""
    names = [v.name for v in model.graph.outputs]
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
    def attempt(specs: list[PassSpec]) -> Built:
        model = copy_model(original)
        if specs and specs[-1].name != "cleanup":
            # A prefix may stop between fusions that leave helper functions behind.
            specs = [*specs, next(s for s in default_pipeline() if s.name == "cleanup")]
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
            guilty = _member(active, crash.spec)
            say(f"{crash}; dropped it")
        else:
            if built.verification is None or built.verification.ok or not active:
                break
            if target.precision != "fp32":
                break  # lower precision drifts by itself: no pass is to blame
            guilty = _bisect(active, attempt, say)
            say(f"pass {guilty.name} broke the outputs; dropped it")
        dropped.append(guilty.name)
        active = [s for s in active if s is not guilty]
    built.dropped = dropped
    return built


def _member(pipeline: list[PassSpec], spec: PassSpec) -> PassSpec:
    """The pipeline's own entry for `spec` (the cleanup appended to a prefix is a copy)."""
    return next((s for s in pipeline if s is spec), None) or next(
        s for s in reversed(pipeline) if s.name == spec.name
    )


def _bisect(pipeline: list[PassSpec], attempt: Callable[[list[PassSpec]], Built], say: Say):
    """Smallest failing prefix: the pass that ends it is the guilty one."""
    low, high = 0, len(pipeline)  # prefix of `low` passes verifies; of `high` fails
    while high - low > 1:
        middle = (low + high) // 2
        say(f"bisecting: trying the first {middle} passes")
        try:
            verification = attempt(pipeline[:middle]).verification
        except PassCrashed:
            high = middle  # a prefix that cannot even run is a failing prefix
            continue
        if verification is None or verification.ok:
            low = middle
        else:
            high = middle
    return pipeline[high - 1]
