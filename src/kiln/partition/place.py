"""Placing a model's parts on engines: the cuts found (independent branches and their join, or
a chain's segments), each part timed on each installed engine with the threads it would get, the
placement predicted fastest built, and the choice against the best single-engine build made
(see kiln.partition for the whole flow). An explicit placement is built as given."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx_ir as ir

from kiln.artifact.parts import PartSpec
from kiln.artifact.store import Artifact
from kiln.backends import available_backends, get_backend
from kiln.compiler.candidate import CompileResult, compile_candidate
from kiln.config import AUTO, ENGINES, NO_PARTITION, CompileConfig, partition_placement
from kiln.errors import KilnError
from kiln.ir import stamp_origins
from kiln.ir.inputs import feed_dims, input_names, read_inputs
from kiln.ir.load import LoadedModel, load_any
from kiln.partition.build import (
    Feeds,
    PartitionedBuild,
    Reference,
    Say,
    build_parts,
    crossing_names,
    record_reference,
)
from kiln.partition.chain import chain_cuts, merge_runs, place_chain
from kiln.partition.choose import build_singles, choose, single_only, time_alone
from kiln.partition.graph import PartCut, find_cuts, pieces
from kiln.partition.measure import Placement, cores, measure_parts, placements, thread_shares
from kiln.partition.write import Save, save_chosen

AUTO_ROUNDS = 5


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
        return single_only(loaded, config, given, given_source, rounds, runs, say)
    total = cores()
    specs = _specs(cuts, config, explicit, total, input_names(loaded.model))
    say("running the original in ONNX Runtime, part by part (reference)")
    split = pieces(loaded.model, cuts)
    reference = record_reference(loaded, config, specs, given, given_source, say)
    split = _with_dims(split, loaded.model, reference.feeds[0])
    if not auto:
        return _placed_by_hand(loaded, config, specs, split, reference, rounds, runs, say)
    engines = _engines()
    feeds = {s.name: {k: reference.values[0][k] for k in s.inputs} for s in specs}
    crossing = [reference.values[0][c] for c in crossing_names(specs, loaded.model)]
    measured = measure_parts(split, specs, engines, feeds, crossing, rounds, runs, say)
    ranked = placements(specs, input_names(loaded.model), engines, measured)
    best = ranked[0]
    specs = [dataclasses.replace(s, engine=best.engines[s.name]) for s in specs]
    built = build_parts(loaded, config, specs, split, reference, say)
    singles = build_singles(loaded, config, given, given_source, say)
    return choose(built, singles, measured, ranked, total, rounds, runs, say)


@dataclass
class Chain:
    """A model with no independent branches, in segments (chain.py)."""

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
    total, names = cores(), input_names(loaded.model)
    outputs = [v.name for v in loaded.model.graph.outputs]
    specs = _specs(segments, config, {}, total, names)
    say(f"the model is a chain of {len(segments)} segments; running the original in ONNX "
        "Runtime (reference)")  # fmt: skip
    split = pieces(loaded.model, segments)
    reference = record_reference(loaded, config, specs, chain.given, chain.given_source, say)
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
    crossing = [reference.values[0][c] for c in crossing_names(specs, loaded.model)]
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
        return single_only(loaded, config, chain.given, chain.given_source, rounds, runs, say,
                            record)  # fmt: skip
    first = [(e, config.precision) for e in chained.part_engines]
    specs = _placed_specs(chained.parts, first, config, total, names)
    split = _with_dims(pieces(loaded.model, chained.parts), loaded.model, reference.feeds[0])
    built = build_parts(loaded, config, specs, split, reference, say)
    singles = build_singles(loaded, config, chain.given, chain.given_source, say)
    ranked = [Placement({s.name: s.engine for s in specs}, chained.predicted_ms)]
    ranked += [
        Placement({s.name: e for s in specs}, sum(m[e] for m in measured.part_ms.values()))
        for e in engines
    ]  # fmt: skip
    return choose(built, singles, measured, ranked, total, rounds, runs, say)


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
    built = build_parts(loaded, config, specs, split, reference, say)
    bench = time_alone(built, rounds, runs, say) if rounds > 0 and built.ok else None
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
