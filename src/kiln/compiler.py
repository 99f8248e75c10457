"""`kiln.compile`: load → passes → verify (bisect on failure) → artifact.

The original runs in ONNX Runtime with basic optimisation in fp32 and is the reference; the
compiled model must match it within the precision's tolerance on the same inputs. A failing
pipeline is bisected to the first guilty pass, which is dropped and reported.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from kiln import __version__
from kiln.artifact import Artifact, check_destination, write_artifact
from kiln.backends import default_options, get_backend
from kiln.backends.ort import OrtOptions
from kiln.errors import KilnError
from kiln.hardware import cpu_info
from kiln.ir import load_model, stamp_origins
from kiln.ir.inputs import default_dims, read_inputs, synthesize
from kiln.ir.load import LoadedModel
from kiln.passes import PassCrashed, PassReport, PassSpec, default_pipeline, run_pipeline
from kiln.passes.simplify import count_nodes
from kiln.verify import Verification, compare, max_abs_diff

REFERENCE_OPTIONS = OrtOptions(optimization="basic")
Progress = Callable[[str], None]


@dataclass
class CompileResult:
    """Everything `compile` learned; `artifact` is None only when nothing was written."""

    loaded: LoadedModel
    model: ir.Model
    reports: list[PassReport]
    verification: Verification | None
    dropped: list[str] = field(default_factory=list)
    nodes_before: int = 0
    feeds: list[dict[str, np.ndarray]] = field(default_factory=list)
    reference: list[list[np.ndarray]] = field(default_factory=list)  # the original's outputs
    backend: str = "ort"
    options: Any = None  # the backend's options the artifact runs with
    precision: str = "fp32"
    plan: dict | None = None  # per-node precision, when not all fp32
    artifact: Artifact | None = None


def copy_model(model: ir.Model) -> ir.Model:
    copy = ir.serde.deserialize_model(ir.serde.serialize_model(model))
    external = [
        v.const_value
        for v in model.graph.initializers.values()
        if isinstance(v.const_value, ir.ExternalTensor)
    ]
    if external:  # weights left on disk are found relative to the model's directory
        ir.external_data.set_base_dir(copy.graph, external[0].base_dir)
    return copy


def reference_feeds(
    model: ir.Model, inputs: str | None, shapes: dict | None = None, sets: int = 2
) -> tuple[list, str]:
    if inputs:
        return [read_inputs(inputs, model)], inputs
    dims = default_dims(model)
    feeds = [synthesize(model, dims, seed=seed, shapes=shapes) for seed in range(sets)]
    return feeds, "synthesized"


def run_reference(
    model: ir.Model, feeds: list[dict[str, np.ndarray]], source: str
) -> list[list[np.ndarray]]:
    exe = get_backend("ort").compile(model, REFERENCE_OPTIONS)
    try:
        return [exe.run(f) for f in feeds]
    except KilnError as exc:
        if source != "synthesized":
            raise
        shapes = ", ".join(f"{k}={'x'.join(map(str, v.shape))}" for k, v in feeds[0].items())
        raise KilnError(
            f"the original model does not run on synthesized inputs ({shapes}): {exc}. "
            "Give input shapes with --shape INPUT=D0xD1x... or real inputs with --inputs."
        ) from None


def engine_noise(
    original: ir.Model,
    feeds: list,
    reference: list[list[np.ndarray]],
    backend: str,
    options: Any,
) -> dict[str, float]:
    """Per output, how far the untouched original moves under the artifact's engine and
    options (another engine's kernels round differently too)."""
    exe = get_backend(backend).compile(original, options)
    names = [v.name for v in original.graph.outputs]
    noise = dict.fromkeys(names, 0.0)
    for feed, ref_set in zip(feeds, reference, strict=True):
        for name, ref, new in zip(names, ref_set, exe.run(feed), strict=True):
            noise[name] = max(noise[name], max_abs_diff(ref, new))
    return noise


def optimize_model(
    loaded: LoadedModel,
    *,
    pipeline: list[PassSpec] | None = None,
    inputs: str | None = None,
    shapes: dict[str, tuple[int, ...]] | None = None,
    verify: bool = True,
    backend: str = "ort",
    precision: str = "fp32",
    options: Any = None,
    progress: Progress | None = None,
) -> CompileResult:
    """Run the pipeline on a copy of the loaded model; verify and bisect unless told not to."""
    say = progress or (lambda _msg: None)
    pipeline = pipeline if pipeline is not None else default_pipeline(engine=backend)
    original = loaded.model
    stamp_origins(original)
    nodes_before = count_nodes(original)
    check_precision(backend, precision)
    if precision == "int8":
        return _quantized(loaded, pipeline, inputs, shapes, verify, backend, progress)
    options = options or default_options(backend, precision)
    feeds, source = reference_feeds(original, inputs, shapes) if verify else ([], "none")
    reference: list[list[np.ndarray]] = []
    noise: dict[str, float] = {}
    if verify:
        say("running the original in ONNX Runtime (reference)")
        reference = run_reference(original, feeds, source)
        noise = engine_noise(original, feeds, reference, backend, options)

    def attempt(specs: list[PassSpec]) -> tuple[ir.Model, list[PassReport], Verification | None]:
        model = copy_model(original)
        if specs and specs[-1].name != "cleanup":
            # A prefix may stop between fusions that leave helper functions behind.
            specs = [*specs, next(s for s in default_pipeline() if s.name == "cleanup")]
        reports = run_pipeline(model, specs, on_step=lambda s: say(f"pass {s.name}"))
        if not verify:
            return model, reports, None
        say("verifying against the original")
        names = [v.name for v in model.graph.outputs]
        try:
            exe = get_backend(backend).compile(model, options)
            outputs = [exe.run(f) for f in feeds]
        except KilnError as exc:
            return model, reports, Verification(False, precision, source, [], error=str(exc))
        verification = compare(names, reference, outputs, source, precision, noise=noise)
        return model, reports, verification

    dropped: list[str] = []
    active = list(pipeline)
    while True:
        try:
            model, reports, verification = attempt(active)
        except PassCrashed as crash:
            guilty = _member(active, crash.spec)
            say(f"{crash}; dropped it")
        else:
            if verification is None or verification.ok or not active:
                break
            if precision != "fp32":
                break  # lower precision drifts by itself: no pass is to blame
            guilty = _bisect(active, attempt, say)
            say(f"pass {guilty.name} broke the outputs; dropped it")
        dropped.append(guilty.name)
        active = [s for s in active if s is not guilty]
    return CompileResult(
        loaded=loaded,
        model=model,
        reports=reports,
        verification=verification,
        dropped=dropped,
        nodes_before=nodes_before,
        feeds=feeds,
        reference=reference,
        backend=backend,
        options=options,
        precision=precision,
    )


PRECISIONS = {"fp32": {"ort", "openvino"}, "bf16": {"openvino"}, "int8": {"ort"}}


CALIBRATION_SETS = 8


def _conv_heavy(model: ir.Model) -> bool:
    """Static QDQ int8 suits Conv-heavy models, dynamic int8 MatMul-heavy ones; which kind
    holds most of the weights decides (no shapes needed, unlike a FLOP count)."""
    from kiln.passes.precision import quantizable

    sizes = {"conv": 0, "matmul": 0}
    for node in quantizable(model).values():
        weight = node.inputs[1].const_value
        sizes["conv" if node.op_type == "Conv" else "matmul"] += weight.size if weight else 0
    return sizes["conv"] > sizes["matmul"]


def _quantized(loaded, pipeline, inputs, shapes, verify, backend, progress) -> CompileResult:
    """The fp32 pipeline, verified, then int8 under the accuracy guard: cosine ≥ 0.99 to the
    original's outputs for every reference sample, restoring sensitive layers if needed.
    Conv-heavy models get static QDQ int8 calibrated on the user's inputs, else on synthetic
    ones (recorded as unproven); the others get dynamic int8."""
    from kiln.backends.ort_quant import quantize_dynamic_int8, quantize_static_int8
    from kiln.passes.precision import (
        PASS_NAME,
        layer_sensitivity,
        quantize_guarded,
        weight_sensitivity,
    )

    if not verify:
        raise KilnError("int8 is only written verified: the accuracy guard measures it.")
    say = progress or (lambda _msg: None)
    static = _conv_heavy(loaded.model)
    if static:
        # The quantizer knows standard ops only; ONNX Runtime fuses the QDQ graph itself.
        pipeline = [s for s in pipeline or default_pipeline(engine=backend) if s.engines is None]
    result = optimize_model(
        loaded, pipeline=pipeline, inputs=inputs, shapes=shapes, backend=backend, progress=progress
    )
    if result.verification is None or not result.verification.ok:
        return result  # save_result reports the fp32 failure
    say("measuring each layer's int8 sensitivity")
    calibration_note = None
    if static:
        sensitivity = weight_sensitivity(result.model)
        if inputs:
            calibration = result.feeds
            calibration_note = {"source": inputs}
        else:
            dims = default_dims(loaded.model)
            calibration = [
                synthesize(loaded.model, dims, seed=100 + i, shapes=shapes)
                for i in range(CALIBRATION_SETS)
            ]
            calibration_note = {
                "source": "synthetic",
                "warning": "calibrated on synthetic inputs: accuracy on real data is unproven; "
                "give real samples with --inputs",
            }

        def quantize(model: ir.Model, kept: list[str]) -> ir.Model:
            return quantize_static_int8(model, calibration, kept)
    else:
        sensitivity = layer_sensitivity(result.model, result.feeds[0])

        def quantize(model: ir.Model, kept: list[str]) -> ir.Model:
            return quantize_dynamic_int8(model, kept)

    names = [v.name for v in result.model.graph.outputs]
    checks: dict[int, Verification] = {}

    def meets_budget(candidate: ir.Model) -> tuple[bool, float]:
        exe = get_backend(backend).compile(candidate, result.options)
        outputs = [exe.run(f) for f in result.feeds]
        check = compare(names, result.reference, outputs, result.verification.inputs, "int8")
        checks[id(candidate)] = check
        return check.ok, min((o.cosine or 1.0) for o in check.outputs) if check.outputs else 1.0

    model, plan, _ = quantize_guarded(result.model, sensitivity, meets_budget, say, quantize)
    result.model, result.verification = model, checks[id(model)]
    if not plan.int8:  # the budget held only with nothing quantized: that is not int8
        result.verification = Verification(
            False, "int8", result.verification.inputs, result.verification.outputs,
            error="int8 meets the accuracy budget only with every layer kept in fp32",
        )  # fmt: skip
    result.precision = "int8"
    result.plan = {
        **plan.to_json(),
        "scheme": "static QDQ (MinMax)" if static else "dynamic",
        "calibration": calibration_note,
    }
    result.reports.append(
        PassReport(PASS_NAME, "precision", len(plan.int8), 0, count_nodes(model), 0.0)
    )
    return result


def check_precision(backend: str, precision: str) -> None:
    if precision not in PRECISIONS:
        raise KilnError(f"unknown precision '{precision}'; use one of {', '.join(PRECISIONS)}.")
    if backend not in PRECISIONS[precision]:
        engines = ", ".join(sorted(PRECISIONS[precision]))
        raise KilnError(
            f"precision {precision} runs on {engines} here, not {backend}; "
            f"use --backend {engines.split(', ')[0]} or --backend auto."
        )


def _member(pipeline: list[PassSpec], spec: PassSpec) -> PassSpec:
    """The pipeline's own entry for `spec` (the cleanup appended to a prefix is a copy)."""
    return next((s for s in pipeline if s is spec), None) or next(
        s for s in reversed(pipeline) if s.name == spec.name
    )


def _bisect(pipeline: list[PassSpec], attempt, say: Progress) -> PassSpec:
    """Smallest failing prefix: the pass that ends it is the guilty one."""
    low, high = 0, len(pipeline)  # prefix of `low` passes verifies; of `high` fails
    while high - low > 1:
        middle = (low + high) // 2
        say(f"bisecting: trying the first {middle} passes")
        try:
            _, _, verification = attempt(pipeline[:middle])
        except PassCrashed:
            high = middle  # a prefix that cannot even run is a failing prefix
            continue
        if verification is None or verification.ok:
            low = middle
        else:
            high = middle
    return pipeline[high - 1]


def build_manifest(result: CompileResult) -> dict:
    loaded, cpu = result.loaded, cpu_info()
    model = result.model
    return {
        "kiln_version": __version__,
        "created": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "source": {
            "name": loaded.name,
            "path": _absolute(loaded.source),
            "fingerprint": loaded.fingerprint,
        },
        "hardware": {"fingerprint": cpu.fingerprint, "cpu": cpu.model, "features": cpu.features},
        "passes": [
            {"name": r.name, "rewrites": r.rewrites, "nodes_created": r.nodes_created}
            for r in result.reports
        ],
        "dropped_passes": result.dropped,
        "nodes": {"before": result.nodes_before, "after": count_nodes(model)},
        "precision": result.plan or {"default": result.precision, "nodes": {}},
        "buckets": [],
        "inputs": [_spec(v) for v in model.graph.inputs],
        "outputs": [_spec(v) for v in model.graph.outputs],
        "dims": default_dims(model),
        "backend": {"name": result.backend, "options": result.options.to_json()},
        "verification": result.verification.to_json() if result.verification else None,
        "benchmark": None,
    }


def _absolute(source: str) -> str:
    """Where to find the original again later (kiln bench reloads it): zoo names stay."""
    return source if source.startswith("zoo:") else str(Path(source).resolve())


def _spec(value: ir.Value) -> dict:
    return {
        "name": value.name,
        "dtype": value.dtype.numpy().name if value.dtype is not None else None,
        "shape": [d if isinstance(d, int) else str(d.value) for d in (value.shape or [])],
    }


def compile(
    model: str | Path,
    output: str | Path | None = None,
    *,
    target: str = "cpu",
    precision: str = "fp32",
    inputs: str | None = None,
    shapes: dict[str, tuple[int, ...]] | None = None,
    verify: bool = True,
    pipeline: list[PassSpec] | None = None,
    backend: str = "ort",
    progress: Progress | None = None,
) -> Artifact:
    """Compile a model (path or `zoo:NAME`) into a verified artifact directory."""
    if target != "cpu":
        raise KilnError(f"target '{target}' is not supported yet; use target='cpu'.")
    loaded = load_model(str(model))
    check_destination(destination_for(loaded, output))
    get_backend(backend)  # an unknown or missing engine fails before any work
    check_precision(backend, precision)
    result = optimize_model(
        loaded,
        pipeline=pipeline,
        inputs=inputs,
        shapes=shapes,
        verify=verify,
        backend=backend,
        precision=precision,
        progress=progress,
    )
    return save_result(result, output)


def save_result(result: CompileResult, output: str | Path | None, benchmark=None) -> Artifact:
    if result.verification is not None and not result.verification.ok:
        if result.precision != "fp32":
            raise KilnError(
                f"{result.loaded.source}: at {result.precision} the outputs drift too far "
                f"({result.verification.summary()}). Nothing was written; use --precision fp32."
            )
        raise KilnError(
            f"{result.loaded.source}: the compiled model does not match the original even "
            f"with every pass dropped ({result.verification.summary()}). Nothing was written."
        )
    manifest = build_manifest(result)
    manifest["benchmark"] = benchmark
    return write_artifact(destination_for(result.loaded, output), result.model, manifest)


def destination_for(loaded: LoadedModel, output: str | Path | None) -> Path:
    return Path(output) if output else Path(f"{loaded.name}.kiln")
