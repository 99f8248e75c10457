"""A partitioned build: the original run on the reference inputs (every tensor the parts
exchange recorded from one run), each part compiled and verified on its piece, and the pipeline
of parts verified against the original within the budgets a single-part compile has."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir

from kiln.artifact.parts import PartSpec, PartsSection, Pipeline, stages
from kiln.backends import get_backend
from kiln.compiler.candidate import CompileResult, compile_candidate
from kiln.compiler.reference import (
    copy_model,
    fit_inputs,
    reference_executable,
    reference_feeds,
    run_reference,
)
from kiln.config import NO_PARTITION, CompileConfig
from kiln.errors import KilnError
from kiln.ir.inputs import input_names
from kiln.ir.ladder import Guess
from kiln.ir.load import LoadedModel, load_any
from kiln.partition.measure import option_overrides
from kiln.verify import Verification, compare, max_abs_diff

Say = Callable[[str], None]
Feeds = dict[str, np.ndarray]


@dataclass
class Reference:
    """The whole model's reference inputs and outputs, and every tensor the parts exchange on
    them (the original's pieces run in order on the reference engine)."""

    feeds: list[Feeds]
    outputs: list[list[np.ndarray]]
    source: str
    values: list[Feeds]  # per input set: every tensor that crosses, and the model's inputs


@dataclass
class PartitionedBuild:
    """Every part compiled and verified, and the pipeline of them verified against the
    original."""

    loaded: LoadedModel
    config: CompileConfig
    section: PartsSection
    results: dict[str, CompileResult]
    pieces: dict[str, ir.Model]
    verification: Verification | None
    reference: Reference

    @property
    def ok(self) -> bool:
        return self.verification is None or self.verification.ok

    def pipeline(self) -> Pipeline:
        """The parts compiled as the artifact runs them, in a pipeline."""
        runners = {}
        for name, result in self.results.items():
            exe = get_backend(result.backend).compile(result.model, result.options)
            runners[name] = exe.run
        return Pipeline(self.section.parts, runners, input_names(self.loaded.model))


def crossing_names(specs: list[PartSpec], model: ir.Model) -> list[str]:
    inputs = set(input_names(model))
    return list(dict.fromkeys(i for s in specs for i in s.inputs if i not in inputs))


def record_reference(
    loaded: LoadedModel,
    config: CompileConfig,
    specs: list[PartSpec],
    given: list[Feeds] | None,
    given_source: str,
    say: Say,
) -> Reference:
    """The original on the reference inputs (as a single-part compile runs it), and the
    tensors that cross, from the same run: the original with them as outputs too. One session
    on the reference engine, not one per piece (an unfused piece's arena holds a long
    sequence's attention scores, and what it held is not all given back)."""
    original = loaded.model
    crossing = crossing_names(specs, original)
    exe = reference_executable(_exposing(original, crossing))
    fit = Guess(dict(config.shapes))
    if not given:
        fit = fit_inputs(exe, original, dict(config.shapes), say)
    feeds, source = reference_feeds(original, given, given_source, fit)
    ran = run_reference(exe, feeds, source)
    names = list(exe.output_names)
    count = len(original.graph.outputs)
    outputs = [r[:count] for r in ran]
    values = [{**f, **dict(zip(names, r, strict=True))} for f, r in zip(feeds, ran, strict=True)]
    return Reference(feeds, outputs, source, values)


def _exposing(model: ir.Model, names: list[str]) -> ir.Model:
    """A copy of `model` that also outputs the tensors `names` (after its own outputs)."""
    copy = copy_model(model)
    made = {v.name: v for node in copy.graph for v in node.outputs if v.name}
    present = {v.name for v in copy.graph.outputs}
    copy.graph.outputs.extend(made[n] for n in names if n in made and n not in present)
    return copy


def _run_part_by_part(
    specs: list[PartSpec],
    compile_piece: Callable[[PartSpec], Any],
    feeds: list[Feeds],
    given: list[str],
) -> list[Feeds]:
    """Every input set through the parts in dependency order, one part compiled at a time and
    let go before the next: what each part holds after a run (an unfused piece's arena holds a
    long sequence's attention scores) is never held for all parts at once."""
    values = [dict(f) for f in feeds]
    for stage in stages(specs, given):
        for spec in stage:
            exe = compile_piece(spec)
            for known in values:
                outputs = exe.run({name: known[name] for name in spec.inputs})
                known.update(zip(spec.outputs, outputs, strict=True))
            del exe
    return values


def build_parts(
    loaded: LoadedModel,
    config: CompileConfig,
    specs: list[PartSpec],
    split: dict[str, ir.Model],
    reference: Reference,
    say: Say,
) -> PartitionedBuild:
    """Each part compiled and verified on its piece (fed what the original hands it on the
    reference inputs), then the pipeline verified against the original."""
    results = {}
    for spec in specs:
        say(f"compiling part {spec.name} for {spec.engine}/{spec.precision}")
        piece = load_any(split[spec.name], f"{loaded.source}#{spec.name}",
                         f"{loaded.name}-{spec.name}")  # fmt: skip
        part_config = config.replace(
            engine=spec.engine, precision=spec.precision, partition=NO_PARTITION,
            engine_options=option_overrides(spec.engine, spec.threads), inputs=None, shapes={},
        )  # fmt: skip
        given = [{k: v[k] for k in spec.inputs} for v in reference.values]
        where = f"{reference.source}, as the original hands them to part {spec.name}"
        result = compile_candidate(piece, part_config, given, where, None, say)
        if not result.ok:
            summary = result.verification.summary() if result.verification else ""
            raise KilnError(
                f"{loaded.source}: part {spec.name} on {spec.engine}/{spec.precision} does "
                f"not match the original's piece ({summary}). Nothing was written."
            )
        results[spec.name] = result
    section = PartsSection(specs, _crossings(specs, reference))
    built = PartitionedBuild(loaded, config, section, results, split, None, reference)
    if config.verify:
        say("verifying the partitioned pipeline against the original")
        built.verification = _verify(built)
    return built


def _crossings(specs: list[PartSpec], reference: Reference) -> list[dict[str, Any]]:
    """Each tensor one part hands another: from, to, dtype, shape and bytes (first input
    set)."""
    values = reference.values[0]
    out = []
    for spec in specs:
        for name in spec.outputs:
            readers = [s.name for s in specs if name in s.inputs]
            if not readers:
                continue
            value = values[name]
            out.append({
                "tensor": name, "from": spec.name, "to": readers, "dtype": str(value.dtype),
                "shape": list(value.shape), "bytes": int(value.nbytes),
            })  # fmt: skip
    return out


def _verify(built: PartitionedBuild) -> Verification:
    """The pipeline of compiled parts against the original, with the budget and tolerance a
    single-part compile has. The engines' own noise is that of the original's pieces placed
    as the parts are (each on its engine, with its options)."""
    ref = built.reference
    names = [v.name for v in built.loaded.model.graph.outputs]
    compiled = _run_all(built.pipeline(), ref.feeds, names)

    def placed(spec: PartSpec) -> Any:
        result = built.results[spec.name]
        options = result.options
        if result.backend == "ort":  # what an unfused piece allocates goes back when it ends
            options = dataclasses.replace(options, memory_arena=False)
        return get_backend(result.backend).compile(built.pieces[spec.name], options)

    given = input_names(built.loaded.model)
    values = _run_part_by_part(built.section.parts, placed, ref.feeds, given)
    as_placed = [[v[n] for n in names] for v in values]
    noise = {
        name: max(max_abs_diff(r[i], p[i]) for r, p in zip(ref.outputs, as_placed, strict=True))
        for i, name in enumerate(names)
    }
    precision = pipeline_precision(built.section.parts)
    return compare(names, ref.outputs, compiled, ref.source, precision, noise=noise,
                   budget=built.config.budget())  # fmt: skip


def _run_all(pipeline: Pipeline, feeds: list[Feeds], names: list[str]) -> list[list[np.ndarray]]:
    try:
        return [[values[n] for n in names] for values in map(pipeline.run, feeds)]
    finally:
        pipeline.close()


def pipeline_precision(parts: list[PartSpec]) -> str:
    """What the pipeline is judged as: fp32 when every part is, else the task budget."""
    lower = [p.precision for p in parts if p.precision != "fp32"]
    return lower[0] if lower else "fp32"
