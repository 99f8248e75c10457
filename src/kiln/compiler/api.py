"""`kiln.compile`: a model and a CompileConfig in, a verified artifact out."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir

from kiln.artifact import (
    Artifact,
    BackendInfo,
    PassRecord,
    SourceInfo,
    check_destination,
    new_manifest,
    source_path,
    write_artifact,
)
from kiln.backends.release import collect_garbage
from kiln.compiler.candidate import CompileResult, compile_candidate, config_label
from kiln.compiler.select import candidates, fastest, time_candidates
from kiln.compiler.torch_check import EXAMPLE, check_against_framework
from kiln.config import NO_PARTITION, TIMING, CompileConfig
from kiln.errors import KilnError
from kiln.frontend import is_torch_model, load_pt2, load_torch
from kiln.ir.inputs import check_feeds, default_dims, read_inputs
from kiln.ir.load import PT2_SUFFIX, LoadedModel, load_any
from kiln.passes import PassSpec
from kiln.passes.simplify import count_nodes
from kiln.units import parse_size

# Any: a torch.nn.Module or torch.export.ExportedProgram (torch is not imported to name them)
ModelLike = str | os.PathLike | onnx.ModelProto | ir.Model | Any
Progress = Callable[[str], None]
# verified candidates → those within a budget, and why each other one is not
Fit = Callable[[list[CompileResult]], tuple[list[CompileResult], dict[str, str]]]
AUTO_ROUNDS = TIMING.rounds


def compile(
    model: ModelLike,
    output: str | os.PathLike | None = None,
    *,
    config: CompileConfig | None = None,
    backend: str | None = None,
    precision: str | None = None,
    inputs: str | Mapping[str, np.ndarray] | None = None,
    shapes: Mapping[str, tuple[int, ...]] | None = None,
    verify: bool | None = None,
    pipeline: list[PassSpec] | list[str] | None = None,
    rounds: int = TIMING.rounds,
    runs: int = TIMING.runs,
    progress: Progress | None = None,
    force: bool = False,
    example_inputs: Any = None,
    dynamic_shapes: Any = None,
    partitioned: PartsBuilder | None = None,
    **settings: Any,
) -> Artifact:
    """Compile a model into a verified artifact directory.

    `model`: a path to an .onnx file or to a .pt2 (torch.export.save), `zoo:NAME`, an
    onnx.ModelProto, an onnx_ir.Model, or a torch.nn.Module traced on `example_inputs` (a
    tuple of its positional arguments, one tensor, or a dict of keyword arguments) with
    `dynamic_shapes` as torch.export takes them (`({0: "batch"},)` keeps dim 0 dynamic). A
    PyTorch model is exported with torch.onnx (dynamo), and the artifact is verified against
    PyTorch's own outputs on the example as well as against the exported graph
    (`manifest.verification.torch`); its provenance names each node's module and source line.
    `output`: the artifact directory; None writes `NAME.kiln` into a new temporary directory
    (the returned `Artifact.path` says where). `config` holds every decision; the keyword
    arguments override its fields (`backend` is its `engine`; any other CompileConfig field,
    e.g. `metric="top1"`, `max_drop=0.02`, `calib="calib/"`, `engine_options={...}`, is
    accepted). The artifact is timed against ONNX Runtime as-is over `rounds` interleaved rounds
    of `runs` runs each, recorded as `manifest.benchmark` (the defaults are `kiln optimize`'s,
    `kiln.config.TimingConfig`; `rounds=0` times nothing and records no benchmark).
    `backend="auto"` / `precision="auto"` build every candidate and keep the fastest verified
    one by that timing (rounds > 0). An existing Kiln artifact at
    `output` is replaced; anything else there (a file, another directory, an artifact holding
    files of the user's) is refused before any work unless `force=True`. `partition="auto"`
    (or a placement, "image=openvino,text=ort") builds the model's independent branches as
    parts on their own engines, run at once by kiln.Session (see kiln.partition): that build
    is `partitioned`'s, which `kiln.compile` hands in (kiln.partition sits above the compiler).
    Raises KilnError, writing nothing, when the result cannot be verified."""
    config = _config(config, backend, precision, inputs, shapes, verify, pipeline, settings)
    if output is not None:  # before an export that may take a while
        check_destination(Path(output), force, source=model)
    loaded = load_source(model, example_inputs, dynamic_shapes)
    destination = _destination(loaded, output)
    check_destination(destination, force, source=model)
    try:
        return compile_loaded(loaded, config, destination, inputs=inputs, pipeline=pipeline,
                              rounds=rounds, runs=runs, progress=progress, force=force,
                              partitioned=partitioned)  # fmt: skip
    except BaseException:
        if output is None:  # the temporary directory made for it
            shutil.rmtree(destination.parent, ignore_errors=True)
        raise


def compile_loaded(
    loaded: LoadedModel,
    config: CompileConfig,
    destination: Path,
    *,
    inputs: str | Mapping[str, np.ndarray] | None = None,
    pipeline: list[PassSpec] | list[str] | None = None,
    rounds: int | None = None,
    runs: int = 10,
    progress: Progress | None = None,
    force: bool = False,
    max_memory_mib: float | None = None,
    measure: Measure | None = None,
    memory: bool | None = None,
    partitioned: PartsBuilder | None = None,
) -> Artifact:
    """A loaded model compiled into `destination` as `config` says: the partitioned build
    its `partition` asks for (by `partitioned`, kiln.partition's builder), or one engine's
    build. Under
    `max_memory_mib` the fastest verified candidate that fits is kept, each measured by
    `measure` (kiln.compiler.memory; the caller hands it in, as the compiler does not run a
    Session). With `measure` given, `memory` (None: for models with MEMORY_FROM_MIB of
    weights or more) records the artifact's own peak resident memory in its benchmark."""
    if max_memory_mib is not None:
        _check_budget(config, max_memory_mib, rounds, measure)
    if config.partition != NO_PARTITION:
        if partitioned is None:
            raise KilnError(
                f"partition={config.partition!r} builds parts on several engines: call "
                "kiln.compile (or kiln optimize), which hands the compiler kiln.partition's "
                "builder."
            )
        given, source = _given_inputs(loaded, inputs if inputs is not None else config.inputs)
        return partitioned(
            loaded, config, destination, given, source, save_result, rounds=rounds, runs=runs,
            progress=progress, force=force,
        )  # fmt: skip
    say = progress or (lambda _msg: None)
    fit = None
    if max_memory_mib is not None and measure is not None:
        from kiln.compiler.memory import fit_candidates

        fit = lambda results: fit_candidates(  # noqa: E731
            results, max_memory_mib, measure, rounds=rounds or 0, runs=runs, say=say
        )
    result, bench = build(loaded, config, inputs=inputs, pipeline=pipeline, rounds=rounds,
                          runs=runs, progress=progress, fit=fit)  # fmt: skip
    if bench is not None and fit is None and measure is not None and _measures(memory, result):
        say("measuring the artifact's peak resident memory (a process of its own)")
        bench["peak_rss_mib"] = _peak_rss(measure(result))
    say("writing the artifact")
    return save_result(result, destination, bench, force=force)


# kiln.partition's compile_partitioned (loaded, config, destination, given inputs, their
# source, save, **settings): handed in, as the compiler may not import the layer above it.
PartsBuilder = Callable[..., Artifact]
# A candidate's memory in MiB, measured by the caller: "peak_mib", "load_mib", "steady_mib",
# and "process_mib", the measuring process's own high-water mark (see kiln.compiler.memory).
Measure = Callable[[CompileResult], Mapping[str, float]]
MEMORY_FROM_MIB = 64  # weights from which a compile measures the artifact's memory unless told


def memory_budget(text: str) -> float:
    """`--max-memory` ("1.5GB", "800MiB") in MiB."""
    try:
        return parse_size(text, bare_unit=None) / 2**20
    except ValueError as exc:
        raise KilnError(f"--max-memory {exc}.") from None  # the parser gives the example


def _check_budget(
    config: CompileConfig, budget_mib: float, rounds: int | None, measure: Measure | None
) -> None:
    if config.partition != NO_PARTITION:
        raise KilnError("--max-memory measures one engine's artifact; use --partition none.")
    if rounds is not None and rounds <= 0:
        raise KilnError(
            "--max-memory times what each memory-saving option costs; use --rounds > 0."
        )
    if budget_mib <= 0 or measure is None:
        raise KilnError("a memory budget needs a size above zero and a way to measure it.")


def _measures(asked: bool | None, result: CompileResult) -> bool:
    """As asked, else whether the weights are large enough for memory to count (and the
    seconds of a measuring process to be small beside the compile)."""
    if asked is not None:
        return asked
    from kiln.ir.weights import weight_bytes

    return weight_bytes(result.model) >= MEMORY_FROM_MIB * 2**20


def _peak_rss(measured: Mapping[str, float]) -> dict[str, float]:
    """The benchmark's `peak_rss_mib`: the artifact's above an interpreter with its engine
    loaded (as `kiln bench` reports each engine's): "load" once open, "run" the high-water
    mark over opening and 10 runs, "steady" what it keeps after them; and "compile", the
    compiling process's own high-water mark (Kiln, both engines, the original and the
    candidates)."""
    keys = {"load": "load_mib", "run": "peak_mib", "steady": "steady_mib",
            "compile": "process_mib"}  # fmt: skip
    return {name: round(measured[key], 1) for name, key in keys.items() if key in measured}


def load_source(
    model: ModelLike, example_inputs: Any = None, dynamic_shapes: Any = None
) -> LoadedModel:
    """Any model `compile` takes, loaded and checked: a PyTorch module, program or .pt2 file
    through `kiln.frontend` (exported to ONNX, with its example and PyTorch's outputs on it),
    anything else through `kiln.ir`."""
    if is_torch_model(model):
        return load_torch(model, example_inputs, dynamic_shapes)
    if example_inputs is not None or dynamic_shapes is not None:
        raise KilnError(
            "example_inputs and dynamic_shapes are for a PyTorch module; give an ONNX model's "
            "reference inputs with inputs= (--inputs) and its dims with shapes= (--shape)."
        )
    if isinstance(model, str | os.PathLike) and str(model).endswith(PT2_SUFFIX):
        return load_pt2(model)
    return load_any(model)


def build(
    loaded: LoadedModel,
    config: CompileConfig,
    *,
    inputs: str | Mapping[str, np.ndarray] | None = None,
    pipeline: list[PassSpec] | list[str] | None = None,
    rounds: int | None = None,
    runs: int = 10,
    progress: Progress | None = None,
    fit: Fit | None = None,
) -> tuple[CompileResult, dict | None]:
    """Every candidate `config` stands for, built and verified; the fastest verified one (or
    the only one) and the benchmark that chose it. A PyTorch source is verified on its example
    inputs (unless others are given) and then against PyTorch's own outputs. `fit`, given the
    verified candidates, returns those that fit a budget and why the others do not (e.g.
    `kiln.compiler.memory.fit_candidates` under --max-memory; it raises when none does); the
    benchmark then holds the pick's `memory` record. Writes nothing."""
    say = progress or (lambda _msg: None)
    given, given_source = _given_inputs(loaded, inputs if inputs is not None else config.inputs)
    if given is None and loaded.example is not None:
        given, given_source = [loaded.example.feeds], EXAMPLE
    specs = pipeline if pipeline and isinstance(pipeline[0], PassSpec) else None
    rounds = (AUTO_ROUNDS if config.is_auto else 0) if rounds is None else rounds
    if config.is_auto and rounds <= 0:
        raise KilnError("auto picks the fastest candidate by timing; use rounds > 0.")
    results, refused = [], {}
    for candidate in candidates(config):
        label = config_label(candidate)
        say(f"compiling for {label}")
        try:
            results.append(compile_candidate(loaded, candidate, given, given_source, specs, say))
        except KilnError as exc:
            if not config.is_auto:
                raise
            refused[label] = str(exc)  # one candidate failing must not cost the others
        collect_garbage()  # its reference session and discarded trials, before the next
    verified = [r for r in results if r.ok]
    refused |= {r.label: r.verification.summary() for r in results if not r.ok}
    if not results:
        raise KilnError(f"{loaded.source}: no candidate could be built: {refused}.")
    if fit is not None and verified:
        verified, over = fit(verified)
        refused |= over
    if rounds <= 0 or not verified:
        result, bench = (verified or results)[0], None
    else:
        result, bench = fastest(verified, time_candidates(verified, rounds, runs, say))
        if fit is None and specs is None and _passes_cost_time(config, bench):
            result, bench = _or_the_original_graph(loaded, result, bench, given, given_source, say)
        bench["refused"] = refused
        if result.memory is not None:
            bench["memory"] = result.memory
    if loaded.example is not None:
        say(f"checking against {loaded.example.framework}'s own outputs")
        check_against_framework(result)
    return result, bench


def _passes_cost_time(config: CompileConfig, bench: dict) -> bool:
    """Kiln's default passes left the one fp32 candidate slower than the original under ONNX
    Runtime as-is, beyond noise (a fused op can be slower than the ops it replaces:
    docs/contributing/engine-notes.md)."""
    default = not config.is_auto and config.pipeline is None and config.precision == "fp32"
    return default and bench.get("verdict") == "slower"


def _or_the_original_graph(
    loaded: LoadedModel,
    result: CompileResult,
    bench: dict,
    given: list | None,
    given_source: str,
    say: Callable[[str], None],
) -> tuple[CompileResult, dict]:
    """The original graph, untouched (no pass, no tidy-up), on the same engine with the same
    settings, timed beside the slower artifact; the faster of the two is kept (within noise,
    the lower P99), and the benchmark's `choice_reason` says which. The artifact built stands
    when the original graph cannot be built or verified."""
    say(
        f"the passes made it slower than ONNX Runtime as-is ({bench['speedup']:.2f}×): "
        "timing the original graph beside it"
    )
    try:
        plain = compile_candidate(
            loaded, result.config.replace(pipeline=()), given, given_source, None, say
        )
    except KilnError:  # the artifact already built stands; this was only a second chance
        return result, bench
    if not plain.ok:
        return result, bench
    rounds, runs = bench["rounds"], bench["runs_per_round"]
    return fastest([result, plain], time_candidates([result, plain], rounds, runs, say))


def save_result(
    result: CompileResult,
    output: str | os.PathLike | None,
    benchmark: dict | None = None,
    force: bool = False,
    buckets: dict[str, list[int]] | None = None,
) -> Artifact:
    """Write the artifact, or refuse (nothing written) when verification failed. `force`
    replaces whatever is at `output`, not only an artifact of Kiln's own files; `buckets`
    is the shape-bucket set every `kiln.Session` of it starts with."""
    if not result.ok:
        summary = result.verification.summary()
        if result.precision != "fp32":
            raise KilnError(
                f"{result.loaded.source}: at {result.precision} the outputs drift too far "
                f"({summary}). Nothing was written; use --precision fp32."
            )
        raise KilnError(
            f"{result.loaded.source}: the compiled model does not match the original even "
            f"with every pass dropped ({summary}). Nothing was written."
        )
    loaded, model = result.loaded, result.model
    manifest = new_manifest(
        source=SourceInfo(loaded.name, source_path(loaded.source), loaded.fingerprint),
        model=model,
        config=result.config,
        backend=BackendInfo(result.backend, result.options.to_json()),
        passes=[PassRecord(r.name, r.rewrites, r.nodes_created, r.note) for r in result.reports],
        dropped_passes=result.dropped,
        nodes={"before": result.nodes_before, "after": count_nodes(model)},
        precision=result.plan or {"default": result.precision, "nodes": {}},
        dims=default_dims(model),
        verification=result.verification,
        benchmark=benchmark,
        notes=result.notes,
        buckets=buckets,
    )
    return write_artifact(_destination(loaded, output), model, manifest, force=force)


def _config(
    config: CompileConfig | None,
    backend: str | None,
    precision: str | None,
    inputs: Any,
    shapes: Mapping[str, tuple[int, ...]] | None,
    verify: bool | None,
    pipeline: list | None,
    settings: dict[str, Any],
) -> CompileConfig:
    changes: dict[str, Any] = dict(settings)
    given = {"engine": backend, "precision": precision, "shapes": shapes, "verify": verify}
    changes |= {k: v for k, v in given.items() if v is not None}
    if isinstance(inputs, str | os.PathLike):
        changes["inputs"] = str(inputs)
    if pipeline:
        changes["pipeline"] = tuple(s.name if isinstance(s, PassSpec) else s for s in pipeline)
    base = config or CompileConfig()
    try:
        return base.replace(**changes)
    except TypeError as exc:
        unknown = sorted(set(changes) - set(base.to_json()))
        if not unknown:  # a known field given a value of the wrong kind
            raise KilnError(f"kiln.compile: {exc}.") from None
        raise KilnError(
            f"kiln.compile got unknown setting(s) {unknown}; the CompileConfig fields are "
            f"{', '.join(sorted(base.to_json()))}."
        ) from None


def _given_inputs(
    loaded: LoadedModel, inputs: str | os.PathLike | Mapping[str, np.ndarray] | None
) -> tuple[list[dict[str, np.ndarray]] | None, str]:
    """The user's reference inputs, read and checked against the model (or None)."""
    if inputs is None:
        return None, "synthesized"
    if isinstance(inputs, str | os.PathLike):
        return [read_inputs(str(inputs), loaded.model)], str(inputs)
    if not isinstance(inputs, Mapping):
        raise KilnError(
            f"inputs must be an .npz path or a dict of input name → numpy array, not "
            f"{type(inputs).__name__}."
        )
    feeds = {name: np.asarray(value) for name, value in inputs.items()}
    check_feeds(loaded.model, feeds, where=f"{loaded.source} inputs")
    return [feeds], "given arrays"


def _destination(loaded: LoadedModel, output: str | os.PathLike | None) -> Path:
    if output is not None:
        return Path(output)
    return Path(tempfile.mkdtemp(prefix="kiln-")) / f"{loaded.name}.kiln"
