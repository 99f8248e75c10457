"""The pass pipeline: data you can print, reorder and bisect.

`run_pipeline` runs each pass under provenance tracking and reports what it did; a pass that
raises, or that leaves an If/Loop/Scan body output made by no node of that body, is reported
as crashed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from kiln.ir.provenance import PassTracker
from kiln.passes.base import KilnPass
from kiln.passes.canonical_mask import CanonicalMaskPass
from kiln.passes.flash_attention import FlashAttentionPass
from kiln.passes.fusions import FUSIONS, FusionPass
from kiln.passes.noop_reshapes import NoopReshapesPass
from kiln.passes.prune_rows import PruneRowsPass
from kiln.passes.refine_shapes import RefineShapesPass
from kiln.passes.scopes import stray_outputs
from kiln.passes.shape_reads import ShapeReadsPass
from kiln.passes.simplify import CleanupPass, SimplifyPass, count_nodes


@dataclass(frozen=True)
class PassSpec:
    """One step of a pipeline: a name, its stage, and how to make the pass."""

    name: str
    stage: str
    make: Callable[[], KilnPass]
    doc: str
    engines: frozenset[str] | None = None  # None: its output runs on any engine


class PassCrashed(Exception):
    """A pass raised instead of returning, or left the model invalid: the pipeline drops it
    like a pass that broke the outputs, rather than failing the whole compile. `index` is its
    position in the pipeline that was run (the same pass may appear there several times)."""

    def __init__(self, spec: PassSpec, error: BaseException, index: int | None = None) -> None:
        super().__init__(f"pass {spec.name} crashed: {type(error).__name__}: {error}")
        self.spec = spec
        self.index = index


class InvalidGraph(Exception):
    """A pass returned a model that breaks ONNX's scoping rules."""


@dataclass
class PassReport:
    name: str
    stage: str
    rewrites: int
    nodes_created: int
    nodes_after: int
    seconds: float
    note: str = ""  # the pass's own word on what it left alone (KilnPass.note)


def _spec(make: Callable[[], KilnPass]) -> PassSpec:
    instance = make()
    return PassSpec(instance.name, instance.stage, make, instance.summary, instance.engines)


def default_pipeline(engine: str = "ort") -> list[PassSpec]:
    """simplify → fuse → cleanup, keeping only passes whose output `engine` can run.
    Precision and layout stages arrive with their issues."""
    # Each simplify/refine round exposes what the next can resolve: the mask probe needs
    # named dims, and shape reads can only be detached once the mask chain is gone.
    specs = [_spec(SimplifyPass), _spec(RefineShapesPass), _spec(CanonicalMaskPass)]
    specs += [_spec(SimplifyPass), _spec(RefineShapesPass), _spec(ShapeReadsPass)]
    specs += [_spec(SimplifyPass), _spec(RefineShapesPass), _spec(NoopReshapesPass)]
    # Dims named only in the last round (a canonical causal mask) free the last shape reads.
    specs.append(_spec(ShapeReadsPass))
    specs.append(_spec(PruneRowsPass))
    specs += [_spec(lambda spec=spec: FusionPass(spec)) for spec in FUSIONS]
    specs.append(_spec(FlashAttentionPass))
    specs.append(_spec(CleanupPass))
    return [s for s in specs if s.engines is None or engine in s.engines]


def format_pipeline(pipeline: list[PassSpec]) -> str:
    width = max(len(spec.name) for spec in pipeline)
    return "\n".join(
        f"{i:2d}. {spec.name:<{width}}  [{spec.stage}{'' if spec.engines is None else ', ort'}]"
        f"  {spec.doc}"
        for i, spec in enumerate(pipeline, 1)
    )


def run_pipeline(
    model: ir.Model,
    pipeline: list[PassSpec],
    on_step: Callable[[PassSpec], None] | None = None,
) -> list[PassReport]:
    """Run every pass in place, stamping provenance; return one report per pass. Raises
    PassCrashed, naming the pass and its position, when one raises or leaves a graph output
    made by no node of its graph (a body output pointing at an outer value)."""
    reports = []
    stray = stray_outputs(model)  # a valid model has none; only new ones are a pass's fault
    for index, spec in enumerate(pipeline):
        if on_step is not None:
            on_step(spec)
        tracker = PassTracker(model, spec.name)
        start = time.perf_counter()
        try:
            kiln_pass = spec.make()
            # Weights may hold NaN, inf or a negative variance: folding them is arithmetic
            # the verification judges, not a numpy warning for the user's terminal.
            with np.errstate(all="ignore"):
                kiln_pass(model)
            broken = sorted(stray_outputs(model) - stray)
            if broken:
                raise InvalidGraph("; ".join(broken))
        except Exception as exc:  # a pass bug must cost that pass, not the compile
            raise PassCrashed(spec, exc, index) from exc
        created = tracker.finish()
        reports.append(
            PassReport(
                name=spec.name,
                stage=spec.stage,
                rewrites=kiln_pass.count,
                nodes_created=created,
                nodes_after=count_nodes(model),
                seconds=time.perf_counter() - start,
                note=kiln_pass.note,
            )
        )
    return reports
