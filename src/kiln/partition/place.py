"""Partitioned compiles: one model as several parts, each compiled for its own engine.

`partition="auto"` finds the model's independent branches and its join (partition_graph.py),
times each part on each installed engine with the threads it would get (partition_measure.py),
places the parts where the predicted end-to-end latency is lowest (the parts of a stage run at
once), compiles and verifies each part through the normal compile path on its piece, and
verifies the whole pipeline against the original on the reference inputs, within the budgets a
single-part compile has. It then times, interleaved, the original under ONNX Runtime as-is,
the best single-engine build of every installed engine and the partitioned build; the
partitioned one is kept when every round says it beats the best single one, or when its median
leads by KEEP_MARGIN and two rounds in three say it is faster (`beats`). An explicit
placement ("image=openvino,text=ort") compiles that placement (parts not named run on the
config's engine).

A model without independent branches is a chain (partition_chain.py): its segments are built
through Kiln's passes for each engine and timed (a chain's gain is what each engine makes of its
stretch), the engines chosen along the chain with a hand-off wherever they change, and runs of
neighbours on one engine become one part; the rest is as for branches. Pieces are run on the
reference one at a time: an unfused piece's arena holds a long sequence's attention scores.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from kiln.artifact import BackendInfo, PassRecord, SourceInfo, new_manifest, provenance_map
from kiln.artifact.manifest import PARTS_BACKEND
from kiln.artifact.parts import PARTS_DIR, PartSpec, PartsSection, Pipeline, stages
from kiln.artifact.store import Artifact, write_partitioned
from kiln.backends import available_backends, get_backend
from kiln.compiler.candidate import CompileResult, compile_candidate
from kiln.compiler.reference import (
    copy_model,
    fit_inputs,
    reference_executable,
    reference_feeds,
    run_reference,
)
from kiln.compiler.select import candidates, fastest, time_candidates
from kiln.config import AUTO, ENGINES, NO_PARTITION, CompileConfig, partition_placement
from kiln.errors import KilnError
from kiln.ir import stamp_origins
from kiln.ir.inputs import default_dims, feed_dims, read_inputs
from kiln.ir.ladder import Guess
from kiln.ir.load import LoadedModel, fingerprint, load_any
from kiln.partition.chain import chain_cuts, merge_runs, place_chain
from kiln.partition.graph import PartCut, find_cuts, pieces
from kiln.partition.measure import (
    Measured,
    Placement,
    cores,
    describe,
    measure_parts,
    option_overrides,
    placements,
    thread_shares,
)
from kiln.passes.simplify import count_nodes
from kiln.timing import (
    FASTER,
    MIN_ROUNDS_FOR_SPREAD,
    interleave,
    round_ratios,
    round_stats,
    speedup,
    speedups,
)
from kiln.verify import Verification, compare, max_abs_diff

Say = Callable[[str], None]
Feeds = dict[str, np.ndarray]
# kiln.compiler.api.save_result, handed in by its caller (the api imports this package)
Save = Callable[..., Artifact]
PARTITIONED = "partitioned"
AUTO_ROUNDS = 5
# A partitioned build holds two engines and hands tensors between them, so it must lead the
# best single build clearly: in every round, or by this much in the median with two rounds in
# three faster. On a 2-core VM runs of seconds spread ±10 % round to round; a chain 1.10×
# faster in its median (bert-base-4k at 4,096 tokens) had one round in 3–5 at 0.95–0.99.
KEEP_MARGIN = 1.05


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
        return Pipeline(self.section.parts, runners, _input_names(self.loaded.model))


def compile_partitioned(
    loaded: LoadedModel,
    config: CompileConfig,
    destination: Path,
    given: list[Feeds] | None,
    given_source: str,
    save: Save,
    *,
    rounds: int | None = None,
    runs: int = 10,
    progress: Say | None = None,
    force: bool = False,
) -> Artifact:
    """`kiln.compile(..., partition=...)`: build, choose, write (see the module docstring)."""
    chosen, bench = build_partitioned(
        loaded, config, given, given_source, rounds=rounds, runs=runs, say=progress
    )
    return save_chosen(chosen, destination, bench, save, force)


def build_partitioned(
    loaded: LoadedModel,
    config: CompileConfig,
    given: list[Feeds] | None,
    given_source: str,
    *,
    rounds: int | None = None,
    runs: int = 10,
    say: Say | None = None,
) -> tuple[PartitionedBuild | CompileResult, dict | None]:
    """The build `config.partition` asks for, and its benchmark (with a "partition" record:
    the placement, each part's time on each engine, the choice and why). Writes nothing."""
    say = say or (lambda _m: None)
    _check(config)
    auto = config.partition == AUTO
    rounds = (AUTO_ROUNDS if auto else 0) if rounds is None else rounds
    if auto and rounds <= 0:
        raise KilnError("partition auto keeps the partitioned build only if it times faster; "
                        "use rounds > 0.")  # fmt: skip
    if given is None and config.inputs is not None:
        given, given_source = [read_inputs(config.inputs, loaded.model)], config.inputs
    if given is None and loaded.example is not None:
        given, given_source = [loaded.example.feeds], "the example inputs"
    stamp_origins(loaded.model)  # before the cut: every part's nodes keep their original names
    cuts = find_cuts(loaded.model)
    explicit = partition_placement(config.partition)
    segments = chain_cuts(loaded.model) if len(cuts) < 2 else []
    if len(segments) >= 2:
        chain = Chain(loaded, config, segments, given, given_source)
        return _chained(chain, explicit, rounds, runs, say)
    _check_placement(loaded, cuts, explicit)
    if len(cuts) < 2:
        return _single_only(loaded, config, given, given_source, rounds, runs, say)
    total = cores()
    specs = _specs(cuts, config, explicit, total, _input_names(loaded.model))
    say("running the original in ONNX Runtime, part by part (reference)")
    split = pieces(loaded.model, cuts)
    reference = _reference(loaded, config, specs, given, given_source, say)
    split = _with_dims(split, loaded.model, reference.feeds[0])
    if not auto:
        return _placed_by_hand(loaded, config, specs, split, reference, rounds, runs, say)
    engines = _engines()
    feeds = {s.name: {k: reference.values[0][k] for k in s.inputs} for s in specs}
    crossing = [reference.values[0][c] for c in _crossing_names(specs, loaded.model)]
    measured = measure_parts(split, specs, engines, feeds, crossing, rounds, runs, say)
    ranked = placements(specs, _input_names(loaded.model), engines, measured)
    best = ranked[0]
    specs = [dataclasses.replace(s, engine=best.engines[s.name]) for s in specs]
    built = _build(loaded, config, specs, split, reference, say)
    singles = _singles(loaded, config, given, given_source, say)
    return _choose(built, singles, measured, ranked, total, rounds, runs, say)


@dataclass
class Chain:
    """A model with no independent branches, in segments (partition_chain.py)."""

    loaded: LoadedModel
    config: CompileConfig
    segments: list[PartCut]
    given: list[Feeds] | None
    given_source: str


def _chained(
    chain: Chain,
    explicit: dict[str, tuple[str, str | None]],
    rounds: int,
    runs: int,
    say: Say,
) -> tuple[PartitionedBuild | CompileResult, dict | None]:
    """A chain of layers: each segment built by Kiln for each engine and timed, the engines
    chosen along the chain, neighbours on one engine made one part; kept only when faster than
    the best single-engine build, as branches are. An explicit placement names segments."""
    loaded, config, segments = chain.loaded, chain.config, chain.segments
    total, names = cores(), _input_names(loaded.model)
    outputs = [v.name for v in loaded.model.graph.outputs]
    specs = _specs(segments, config, {}, total, names)
    say(f"the model is a chain of {len(segments)} segments; running the original in ONNX "
        "Runtime (reference)")  # fmt: skip
    split = pieces(loaded.model, segments)
    reference = _reference(loaded, config, specs, chain.given, chain.given_source, say)
    split = _with_dims(split, loaded.model, reference.feeds[0])
    if explicit:
        placed = _chain_placement(loaded, config, segments, explicit)
        labels = [f"{engine}:{precision}" for engine, precision in placed]
        parts = merge_runs(segments, labels, outputs)
        specs = _placed_specs(parts, [placed[i] for i in _run_starts(labels)], config, total,
                              names)  # fmt: skip
        split = _with_dims(pieces(loaded.model, parts), loaded.model, reference.feeds[0])
        return _placed_by_hand(loaded, config, specs, split, reference, rounds, runs, say)
    engines = _engines()
    feeds = {s.name: {k: reference.values[0][k] for k in s.inputs} for s in specs}
    crossing = [reference.values[0][c] for c in _crossing_names(specs, loaded.model)]
    measured = measure_parts(split, specs, engines, feeds, crossing[:1], rounds, runs, say,
                             compile_piece=_segment_builder(loaded, config, split))  # fmt: skip
    chained = place_chain(segments, measured.part_ms, measured.handoff_ms, outputs)
    if len(chained.parts) < 2:
        record = {
            "choice": "single", "parts": [s.name for s in segments], **measured.to_json(),
            "why": f"every one of the chain's {len(segments)} segments measured fastest on "
            f"{chained.part_engines[0]} (with hand-offs of {measured.handoff_ms:.2f} ms): "
            "one part",
        }  # fmt: skip
        return _single_only(loaded, config, chain.given, chain.given_source, rounds, runs, say,
                            record)  # fmt: skip
    first = [(e, config.precision) for e in chained.part_engines]
    specs = _placed_specs(chained.parts, first, config, total, names)
    split = _with_dims(pieces(loaded.model, chained.parts), loaded.model, reference.feeds[0])
    built = _build(loaded, config, specs, split, reference, say)
    singles = _singles(loaded, config, chain.given, chain.given_source, say)
    ranked = [Placement({s.name: s.engine for s in specs}, chained.predicted_ms)]
    ranked += [
        Placement({s.name: e for s in specs}, sum(m[e] for m in measured.part_ms.values()))
        for e in engines
    ]  # fmt: skip
    return _choose(built, singles, measured, ranked, total, rounds, runs, say)


def _placed_by_hand(
    loaded: LoadedModel,
    config: CompileConfig,
    specs: list[PartSpec],
    split: dict[str, ir.Model],
    reference: Reference,
    rounds: int,
    runs: int,
    say: Say,
) -> tuple[PartitionedBuild, dict | None]:
    """An explicit placement: built and verified, timed alone against the original when
    rounds > 0."""
    built = _build(loaded, config, specs, split, reference, say)
    bench = _time_alone(built, rounds, runs, say) if rounds > 0 and built.ok else None
    return built, bench


def _chain_placement(
    loaded: LoadedModel,
    config: CompileConfig,
    segments: list[PartCut],
    explicit: dict[str, tuple[str, str | None]],
) -> list[tuple[str, str]]:
    """(engine, precision) per segment from a placement naming segments by name or by their
    `sNN` prefix; the others on the config's engine."""
    default = config.engine if config.engine != AUTO else "ort"
    short = {s.name.split("_")[0]: s.name for s in segments}
    named = {short.get(k, k): v for k, v in explicit.items()}
    unknown = [k for k in named if k not in {s.name for s in segments}]
    if unknown:
        raise KilnError(
            f"--partition: {loaded.source} has no part '{unknown[0]}'; it is a chain of "
            f"segments {', '.join(s.name for s in segments)} (name one, or its sNN)."
        )
    out = []
    for segment in segments:
        engine, precision = named.get(segment.name, (default, None))
        out.append((engine, precision or config.precision))
    return out


def _run_starts(labels: list[str]) -> list[int]:
    return [i for i, label in enumerate(labels) if i == 0 or labels[i - 1] != label]


def _placed_specs(
    parts: list[PartCut],
    placed: list[tuple[str, str]],
    config: CompileConfig,
    total: int,
    names: list[str],
) -> list[PartSpec]:
    specs = _specs(parts, config, {}, total, names)
    return [
        dataclasses.replace(s, engine=engine, precision=precision)
        for s, (engine, precision) in zip(specs, placed, strict=True)
    ]  # fmt: skip


def _segment_builder(
    loaded: LoadedModel, config: CompileConfig, split: dict[str, ir.Model]
) -> Callable[[str, str, Any], Any]:
    """How a segment is compiled for timing: through Kiln's passes for the engine (a chain's
    gain is in what each engine makes of its stretch: ONNX Runtime's flash attention,
    OpenVINO's fused GEMMs), unverified — the parts built from them are verified."""

    def compile_piece(name: str, engine: str, options: Any) -> Any:
        piece = load_any(split[name], f"{loaded.source}#{name}", f"{loaded.name}-{name}")
        part_config = config.replace(
            engine=engine, partition=NO_PARTITION, inputs=None, shapes={}, verify=False,
            engine_options={},
        )  # fmt: skip
        result = compile_candidate(piece, part_config, None, "", None, lambda _m: None)
        return get_backend(engine).compile(result.model, options)

    return compile_piece


def _with_dims(split: dict[str, ir.Model], model: ir.Model, feeds: Feeds) -> dict[str, ir.Model]:
    """The pieces carrying the whole model's `kiln.dims` at the reference inputs' sizes:
    passes that read the compiled length (flash attention) see what the whole is built for."""
    recorded = json.loads(model.metadata_props.get("kiln.dims", "{}"))
    dims = json.dumps({**recorded, **feed_dims(model, feeds)})
    for piece in split.values():
        piece.metadata_props["kiln.dims"] = dims
    return split


def save_chosen(
    chosen: PartitionedBuild | CompileResult,
    destination: Path,
    bench: dict | None,
    save: Save,
    force: bool = False,
) -> Artifact:
    """Write what `build_partitioned` chose with `save` (`kiln.compiler.save_result`): a
    single-part artifact as any compile writes it, or a partitioned one whose parts are each
    such an artifact. Nothing is written when verification failed."""
    if isinstance(chosen, CompileResult):
        return save(chosen, destination, bench, force=force)
    if not chosen.ok:
        summary = chosen.verification.summary() if chosen.verification else ""
        raise KilnError(
            f"{chosen.loaded.source}: the partitioned pipeline does not match the original "
            f"({summary}). Nothing was written; use --partition none."
        )
    return _write(chosen, Path(destination), bench, save, force)


# ----------------------------------------------------------------------------- checks


def _check(config: CompileConfig) -> None:
    if config.precision == AUTO:
        raise KilnError("a partitioned compile needs one precision: give --precision fp32 (or "
                        "per part: --partition image=openvino:bf16,...).")  # fmt: skip
    if config.engine_options:
        raise KilnError("engine options apply to one engine; a partitioned compile sets each "
                        "part's threads itself: drop them or use --partition none.")  # fmt: skip


def _check_placement(
    loaded: LoadedModel, cuts: list[PartCut], explicit: dict[str, tuple[str, str | None]]
) -> None:
    """An explicit placement names parts the model has; before any compile."""
    if not explicit:
        return
    names = [c.name for c in cuts]
    if len(cuts) < 2:
        raise KilnError(
            f"{loaded.source}: the model has no independent branches (one part: join); "
            "there is nothing to place: use --partition none."
        )
    unknown = [p for p in explicit if p not in names]
    if unknown:
        raise KilnError(
            f"--partition: {loaded.source} has no part '{unknown[0]}'; its parts are "
            f"{', '.join(names)}."
        )


def _engines() -> list[str]:
    return [e for e in available_backends() if e in ENGINES]


def _input_names(model: ir.Model) -> list[str]:
    return [v.name for v in model.graph.inputs if v.name not in model.graph.initializers]


def _specs(
    cuts: list[PartCut],
    config: CompileConfig,
    explicit: dict[str, tuple[str, str | None]],
    total: int,
    given: list[str],
) -> list[PartSpec]:
    default = config.engine if config.engine != AUTO else "ort"
    specs = []
    for cut in cuts:
        engine, precision = explicit.get(cut.name, (default, None))
        specs.append(PartSpec(cut.name, engine, precision or config.precision, 1,
                              cut.inputs, cut.outputs, cut.nodes))  # fmt: skip
    threads = thread_shares(specs, given, total)
    return [dataclasses.replace(s, threads=threads[s.name]) for s in specs]


def _crossing_names(specs: list[PartSpec], model: ir.Model) -> list[str]:
    inputs = set(_input_names(model))
    return list(dict.fromkeys(i for s in specs for i in s.inputs if i not in inputs))


# ----------------------------------------------------------------------------- reference


def _reference(
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
    crossing = _crossing_names(specs, original)
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


# ----------------------------------------------------------------------------- building


def _build(
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

    given = _input_names(built.loaded.model)
    values = _run_part_by_part(built.section.parts, placed, ref.feeds, given)
    as_placed = [[v[n] for n in names] for v in values]
    noise = {
        name: max(max_abs_diff(r[i], p[i]) for r, p in zip(ref.outputs, as_placed, strict=True))
        for i, name in enumerate(names)
    }
    precision = _precision(built.section.parts)
    return compare(names, ref.outputs, compiled, ref.source, precision, noise=noise,
                   budget=built.config.budget())  # fmt: skip


def _run_all(pipeline: Pipeline, feeds: list[Feeds], names: list[str]) -> list[list[np.ndarray]]:
    try:
        return [[values[n] for n in names] for values in map(pipeline.run, feeds)]
    finally:
        pipeline.close()


def _precision(parts: list[PartSpec]) -> str:
    """What the pipeline is judged as: fp32 when every part is, else the task budget."""
    lower = [p.precision for p in parts if p.precision != "fp32"]
    return lower[0] if lower else "fp32"


# ----------------------------------------------------------------------------- choosing


def _singles(
    loaded: LoadedModel,
    config: CompileConfig,
    given: list[Feeds] | None,
    given_source: str,
    say: Say,
) -> list[CompileResult]:
    """The whole model built on every installed engine (the single parts to beat)."""
    whole = config.replace(engine=AUTO, partition=NO_PARTITION)
    results = []
    for candidate in candidates(whole):
        say(f"compiling the whole model for {candidate.engine}/{candidate.precision}")
        try:
            result = compile_candidate(loaded, candidate, given, given_source, None, say)
        except KilnError:
            continue  # one engine failing must not cost the others
        if result.ok:
            results.append(result)
    return results


def _single_only(
    loaded: LoadedModel,
    config: CompileConfig,
    given: list[Feeds] | None,
    given_source: str,
    rounds: int,
    runs: int,
    say: Say,
    record: dict[str, Any] | None = None,
) -> tuple[CompileResult, dict]:
    """One part: the fastest single-engine build, and why (`record`: the partition record
    that says it; by default, no independent branches and no cut point in the chain)."""
    singles = _singles(loaded, config, given, given_source, say)
    if not singles:
        raise KilnError(f"{loaded.source}: no engine could build a verified artifact.")
    result, bench = fastest(singles, time_candidates(singles, rounds, runs, say))
    bench["partition"] = record or {
        "choice": "single",
        "why": "the model has no independent branches and no point where one tensor carries "
        "everything on: there is one part",
        "parts": ["join"],
    }
    return result, bench


def _choose(
    built: PartitionedBuild,
    singles: list[CompileResult],
    measured: Measured,
    ranked: list[Placement],
    total: int,
    rounds: int,
    runs: int,
    say: Say,
) -> tuple[PartitionedBuild | CompileResult, dict]:
    """Time the original, every single-engine build and the partitioned one, interleaved; keep
    the partitioned one only when it `beats` the best single one."""
    if not built.ok:
        raise KilnError(
            f"{built.loaded.source}: the partitioned pipeline does not match the original "
            f"({built.verification.summary() if built.verification else ''}). Nothing was "
            "written; use --partition none."
        )
    pipeline = built.pipeline()
    try:
        samples = _interleaved(built, singles, pipeline, rounds, runs, say)
    finally:
        pipeline.close()
    compared = speedups(samples, "ort")
    best = max(singles, key=lambda r: compared[r.label].value) if singles else None
    versus = speedup(samples[best.label], samples[PARTITIONED]) if best else None
    keep = best is None or beats(samples[best.label], samples[PARTITIONED])
    record = _record(built, measured, ranked, total, samples, best, versus, keep)
    built.section.placement = record
    bench = _bench(samples, compared, PARTITIONED if keep else best.label, rounds, runs)
    bench["partition"] = record
    return (built if keep else best), bench


def beats(single: list[list[float]], partitioned: list[list[float]]) -> bool:
    """Whether the partitioned build leads the single one clearly (per round, the per-run
    seconds of each, interleaved): faster in every round, or KEEP_MARGIN faster in the median
    with at least two rounds in three faster (and at least MIN_ROUNDS_FOR_SPREAD rounds)."""
    versus = speedup(single, partitioned)
    if versus.verdict == FASTER:
        return True
    faster, rounds = rounds_faster(single, partitioned)
    return (
        rounds >= MIN_ROUNDS_FOR_SPREAD and versus.value >= KEEP_MARGIN and 3 * faster >= 2 * rounds
    )


def rounds_faster(single: list[list[float]], partitioned: list[list[float]]) -> tuple[int, int]:
    """In how many of the rounds the partitioned build was faster, and how many there were."""
    ratios = round_ratios(single, partitioned)
    return sum(r > 1 for r in ratios), len(ratios)


def _interleaved(
    built: PartitionedBuild,
    singles: list[CompileResult],
    pipeline: Pipeline,
    rounds: int,
    runs: int,
    say: Say,
) -> dict[str, list[list[float]]]:
    from kiln.backends.ort import OrtOptions

    feeds = built.reference.feeds[0]
    original = get_backend("ort").compile(
        built.loaded.model, OrtOptions(optimization="all", stop_spinning=False)
    )  # ORT as-is, as every compile's benchmark has it
    runners: dict[str, Callable[[], object]] = {"ort": lambda: original.run(feeds)}
    for result in singles:
        exe = get_backend(result.backend).compile(result.model, result.options)
        runners[result.label] = (lambda e: lambda: e.run(feeds))(exe)
    runners[PARTITIONED] = lambda: pipeline.run(feeds)
    say("timing the original, each single-engine build and the partitioned one, interleaved")
    return interleave(runners, rounds=rounds, runs=runs,
                      on_round=lambda r: say(f"timing round {r}/{rounds}"))  # fmt: skip


def _record(
    built: PartitionedBuild,
    measured: Measured,
    ranked: list[Placement],
    total: int,
    samples: dict[str, list[list[float]]],
    best: CompileResult | None,
    versus: Any,
    keep: bool,
) -> dict[str, Any]:
    """The placement's record: what was predicted, what was measured, and why it was kept."""
    measured_ms = round_stats(samples[PARTITIONED]).p50_ms
    chosen = ranked[0]
    record: dict[str, Any] = {
        "choice": PARTITIONED if keep else "single",
        "placement": describe(chosen),
        "threads": {p.name: p.threads for p in built.section.parts},
        "cores": total,
        "predicted_ms": chosen.predicted_ms,
        "measured_ms": measured_ms,
        **measured.to_json(),
        "placements": [
            {"placement": describe(p), "predicted_ms": p.predicted_ms} for p in ranked
        ],  # fmt: skip
        "single_ms": {
            label: round_stats(s).p50_ms
            for label, s in samples.items()
            if label not in ("ort", PARTITIONED)
        },  # fmt: skip
    }
    if best is None:
        record["why"] = "no single-engine build verified: the partitioned one is the only one"
        return record
    record["best_single"] = best.label
    record["vs_best_single"] = versus.to_json()
    faster, rounds = rounds_faster(samples[best.label], samples[PARTITIONED])
    record["rounds_faster"] = [faster, rounds]
    spread = versus.spread or (versus.value, versus.value)
    figures = f"{versus.value:.2f}× (rounds {spread[0]:.2f}–{spread[1]:.2f}×)"
    faster_in = f"{faster} of {rounds} rounds faster"
    if keep and versus.verdict == FASTER:
        record["why"] = f"faster than the best single engine ({best.label}) in every round: "
        record["why"] += figures
    elif keep:
        record["why"] = (
            f"faster than the best single engine ({best.label}) by {figures} in the median, "
            f"{faster_in} (kept at ≥ {KEEP_MARGIN:.2f}× with two rounds in three)"
        )
    else:
        record["why"] = (
            f"not clearly faster than the best single engine ({best.label}): {figures}, "
            f"{faster_in} (needs every round, or ≥ {KEEP_MARGIN:.2f}× with two in three); "
            "kept one part"
        )
    return record


def _bench(
    samples: dict[str, list[list[float]]],
    compared: dict[str, Any],
    choice: str,
    rounds: int,
    runs: int,
) -> dict[str, Any]:
    """The manifest's benchmark, as `select.fastest` records one: the chosen build against the
    original under ONNX Runtime as-is, and every candidate's speedup."""
    timed = {
        label: {**round_stats(s).to_json(), **compared[label].to_json()}
        for label, s in samples.items()
        if label != "ort"
    }
    chosen = timed[choice]
    return {
        "rounds": rounds,
        "runs_per_round": runs,
        "original_ort": round_stats(samples["ort"]).to_json(),
        "artifact": chosen,
        "speedup": chosen["speedup"],
        "speedup_spread": chosen["speedup_spread"],
        "verdict": chosen["verdict"],
        "choice": choice,
        "candidates": {name: c["speedup"] for name, c in timed.items()},
        "candidate_verdicts": {
            name: {k: c[k] for k in ("speedup", "speedup_spread", "verdict")}
            for name, c in timed.items()
        },
    }


def _time_alone(built: PartitionedBuild, rounds: int, runs: int, say: Say) -> dict[str, Any]:
    """An explicit placement with rounds > 0: the pipeline against the original as-is."""
    pipeline = built.pipeline()
    try:
        samples = _interleaved(built, [], pipeline, rounds, runs, say)
    finally:
        pipeline.close()
    compared = speedups(samples, "ort")
    bench = _bench(samples, compared, PARTITIONED, rounds, runs)
    built.section.placement = {
        "choice": PARTITIONED,
        "placement": ",".join(f"{p.name}={p.engine}" for p in built.section.parts),
        "threads": {p.name: p.threads for p in built.section.parts},
        "measured_ms": round_stats(samples[PARTITIONED]).p50_ms,
        "why": "placement given",
    }
    bench["partition"] = built.section.placement
    return bench


# ----------------------------------------------------------------------------- writing


def _write(
    built: PartitionedBuild, destination: Path, bench: dict | None, save: Save, force: bool
) -> Artifact:
    section = built.section
    if not section.placement:
        section.placement = {
            "choice": PARTITIONED,
            "placement": ",".join(f"{p.name}={p.engine}" for p in section.parts),
            "threads": {p.name: p.threads for p in section.parts},
            "why": "placement given",
        }
    final = destination.absolute()

    def fill(tmp: Path) -> None:
        (tmp / PARTS_DIR).mkdir()
        for spec in section.parts:
            ir.save(built.pieces[spec.name], tmp / spec.piece)
            result = built.results[spec.name]
            source = str(final / spec.piece)  # the part's original: kiln compare finds it
            part = dataclasses.replace(result, loaded=dataclasses.replace(
                result.loaded, source=source, fingerprint=fingerprint(built.pieces[spec.name])
            ))  # fmt: skip
            save(part, tmp / spec.path)

    manifest = _manifest(built, bench)
    return write_partitioned(destination, manifest, _provenance(built), fill, force)


def _manifest(built: PartitionedBuild, bench: dict | None) -> Any:
    from kiln.artifact.manifest import source_path

    loaded, results = built.loaded, built.results
    passes: Counter[str] = Counter()
    created: Counter[str] = Counter()
    for result in results.values():
        for report in result.reports:
            passes[report.name] += report.rewrites
            created[report.name] += report.nodes_created
    manifest = new_manifest(
        source=SourceInfo(loaded.name, source_path(loaded.source), loaded.fingerprint),
        model=loaded.model,
        config=built.config,
        backend=BackendInfo(PARTS_BACKEND, {}),
        passes=[PassRecord(name, passes[name], created[name]) for name in passes],
        dropped_passes=[f"{p}: {d}" for p, r in results.items() for d in r.dropped],
        nodes={
            "before": count_nodes(loaded.model),
            "after": sum(count_nodes(r.model) for r in results.values()),
        },  # fmt: skip
        precision={"default": _precision(built.section.parts), "nodes": {}},
        dims=default_dims(loaded.model),
        verification=built.verification,
        benchmark=bench,
        notes=[f"part {p}: {n}" for p, r in results.items() for n in r.notes],
    )
    manifest.parts = built.section.to_json()
    return manifest


def _provenance(built: PartitionedBuild) -> dict[str, dict[str, Any]]:
    """Each part's compiled nodes (as `PART/NODE`) → the original nodes and passes."""
    out = {}
    for name, result in built.results.items():
        for node, entry in provenance_map(result.model).items():
            out[f"{name}/{node}"] = {**entry, "part": name}
    return out


__all__ = ["PartitionedBuild", "build_partitioned", "compile_partitioned", "save_chosen"]
