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
from kiln.ir.inputs import default_dims, read_calibration, read_inputs, synthesize
from kiln.ir.load import LoadedModel
from kiln.passes import PassCrashed, PassReport, PassSpec, default_pipeline, run_pipeline
from kiln.passes.simplify import count_nodes
from kiln.verify import Budget, Verification, compare, max_abs_diff

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


@dataclass(frozen=True)
class PrecisionOptions:
    """How a lower precision is judged (`budget`) and, for static int8, calibrated: on the
    user's samples (`calib`, an .npz or a directory of them) by `method`; int4 packs weights in
    blocks of `block_size`."""

    budget: Budget = field(default_factory=Budget)
    calib: str | None = None
    method: str = "minmax"
    block_size: int = 32


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
    model: ir.Model, inputs: str | list | None, shapes: dict | None = None, sets: int = 2
) -> tuple[list, str]:
    if isinstance(inputs, list):  # samples held out of the user's calibration set
        return inputs, "held-out calibration samples"
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
    inputs: str | list | None = None,
    shapes: dict[str, tuple[int, ...]] | None = None,
    verify: bool = True,
    backend: str = "ort",
    precision: str = "fp32",
    options: Any = None,
    progress: Progress | None = None,
    precision_options: PrecisionOptions | None = None,
) -> CompileResult:
    """Run the pipeline on a copy of the loaded model; verify and bisect unless told not to."""
    say = progress or (lambda _msg: None)
    pipeline = pipeline if pipeline is not None else default_pipeline(engine=backend)
    original = loaded.model
    stamp_origins(original)
    nodes_before = count_nodes(original)
    check_precision(backend, precision)
    accuracy = precision_options or PrecisionOptions()
    if precision in QUANTIZED:
        return _quantized(
            loaded, pipeline, inputs, shapes, verify, backend, precision, accuracy, progress
        )
    options = options or default_options(backend, precision)
    feeds, source = reference_feeds(original, inputs, shapes) if verify else ([], "none")
    reference: list[list[np.ndarray]] = []
    noise: dict[str, float] = {}
    if verify:
        say("running the original in ONNX Runtime (reference)")
        reference = run_reference(original, feeds, source)
        noise = engine_noise(original, feeds, reference, backend, options)

    last: dict[str, Any] = {}  # the final attempt's executable, for the bf16 plan

    def attempt(specs: list[PassSpec]) -> tuple[ir.Model, list[PassReport], Verification | None]:
        last.clear()
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
        last["exe"] = exe
        verification = compare(
            names, reference, outputs, source, precision, noise=noise, budget=accuracy.budget
        )
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
        plan=_engine_plan(model, backend, options, last.get("exe"))
        if precision == "bf16"
        else None,
    )


def _engine_plan(model: ir.Model, backend: str, options: Any, exe: Any = None) -> dict:
    """bf16 is the engine's decision layer by layer: record the layers it kept in fp32 (read
    from the executable verification already built, when there is one)."""
    exe = exe or get_backend(backend).compile(model, options)
    nodes = {n.name for n in model.graph}  # the engine also names layers it made itself
    kept = {
        name: f"fp32 (kept by {backend}: {kind})"
        for name, (precision, kind) in exe.layer_precisions().items()
        if precision == "f32" and name in nodes
    }
    return {"default": "bf16", "scheme": f"{backend} inference precision bf16", "nodes": kept}


PRECISIONS = {
    "fp32": {"ort", "openvino"},
    "bf16": {"openvino"},
    "int8": {"ort", "openvino"},
    "int4": {"ort"},
}
QUANTIZED = ("int8", "int4")
CALIBRATION_SETS = 8


def _quantized(
    loaded, pipeline, inputs, shapes, verify, backend, precision, accuracy, progress
) -> CompileResult:
    """The fp32 pipeline, verified, then int8/int4 under the accuracy guard: the budget's
    metric on every held-out sample, restoring the most sensitive layers until it holds.
    Static int8 (Conv-heavy models on ORT; every model on OpenVINO, through NNCF) is calibrated
    on the user's samples, else on synthetic ones (recorded as unproven)."""
    from kiln.passes.precision import conv_heavy, pass_name, quantize_guarded

    if not verify:
        raise KilnError(f"{precision} is only written verified: the accuracy guard measures it.")
    say = progress or (lambda _msg: None)
    conv = conv_heavy(loaded.model)
    static = precision == "int8" and (conv or backend == "openvino")
    if static:
        # The quantizers know standard ops only; the engines fuse the QDQ graph themselves.
        pipeline = [s for s in pipeline or default_pipeline(engine=backend) if s.engines is None]
    samples, held_out, note = _calibration(loaded, accuracy, inputs, shapes, static)
    result = optimize_model(
        loaded,
        pipeline=pipeline,
        inputs=held_out or inputs,
        shapes=shapes,
        backend=backend,
        progress=progress,
        precision_options=accuracy,
    )
    if result.verification is None or not result.verification.ok:
        return result  # save_result reports the fp32 failure
    result.options = default_options(backend, precision)
    say(f"measuring each layer's {precision} sensitivity")
    sensitivity, quantize, scheme = _quantizer(result, precision, conv, samples, accuracy)
    result.precision = precision
    if not sensitivity:
        result.verification = Verification(
            False, precision, result.verification.inputs, [],
            error=f"the model has no layers {precision} quantizes ({scheme})",
        )  # fmt: skip
        return result
    names = [v.name for v in result.model.graph.outputs]
    checks: dict[int, Verification] = {}

    def meets_budget(candidate: ir.Model) -> tuple[bool, float]:
        exe = get_backend(backend).compile(candidate, result.options)
        outputs = [exe.run(f) for f in result.feeds]
        check = compare(
            names, result.reference, outputs, result.verification.inputs, precision,
            budget=accuracy.budget,
        )  # fmt: skip
        checks[id(candidate)] = check
        return check.ok, check.score

    model, plan, _ = quantize_guarded(
        result.model, sensitivity, meets_budget, say, quantize, precision
    )
    if getattr(result.options, "inference_precision", None) == "bf16":
        plan.restored_to = "bf16"
    result.model, result.verification = model, checks[id(model)]
    if not plan.int8:  # the budget held only with nothing quantized: that is not int8
        result.verification.ok = False
        result.verification.error = (
            f"{precision} meets the accuracy budget only with every layer kept in fp32"
        )
    result.precision = precision
    result.plan = {**plan.to_json(), "scheme": scheme, "calibration": note}
    result.reports.append(
        PassReport(pass_name(precision), "precision", len(plan.int8), 0, count_nodes(model), 0.0)
    )
    return result


def _calibration(
    loaded: LoadedModel, accuracy: PrecisionOptions, inputs, shapes, static: bool
) -> tuple[list | None, list | None, dict | None]:
    """(calibration samples, held-out samples for the guard, the manifest's note). The user's
    --calib samples calibrate; without --inputs a quarter of them is held out for the guard."""
    model = loaded.model
    samples = read_calibration(accuracy.calib, model) if accuracy.calib else None
    if samples and not static:  # nothing to calibrate: all of them judge the accuracy
        return None, (None if inputs else samples), None
    if not static:
        return None, None, None
    if samples:
        if inputs or len(samples) < 2:
            return samples, None, {"source": accuracy.calib, "method": accuracy.method}
        held = max(1, len(samples) // 4)
        note = {"source": accuracy.calib, "method": accuracy.method, "held_out": held}
        return samples[:-held], samples[-held:], note
    if inputs:
        return [read_inputs(inputs, model)], None, {
            "source": inputs,
            "method": accuracy.method,
            "warning": "calibrated on the verification inputs themselves; give separate "
            "samples with --calib",
        }
    dims = default_dims(model)
    synthetic = [
        synthesize(model, dims, seed=100 + i, shapes=shapes) for i in range(CALIBRATION_SETS)
    ]
    return synthetic, None, {
        "source": "synthetic",
        "method": accuracy.method,
        "warning": "calibrated on synthetic inputs: accuracy on real data is unproven; "
        "give real samples with --calib",
    }


def _quantizer(result: CompileResult, precision: str, conv: bool, samples, accuracy):
    """(per-layer sensitivity, quantize(model, layers kept fp32), scheme) for the engine."""
    from kiln.backends.ort_quant import quantize_dynamic_int8, quantize_int4, quantize_static_int8
    from kiln.passes.precision import activation_matmuls, layer_sensitivity, weight_sensitivity

    model, size = result.model, accuracy.block_size
    if precision == "int4":
        return (
            weight_sensitivity(model, bits=4, block=size, ops=("MatMul",)),
            lambda m, kept: quantize_int4(m, kept, size),
            f"4-bit weights (MatMulNBits, block {size})",
        )
    sensitivity = weight_sensitivity(model) if conv else layer_sensitivity(model, result.feeds[0])
    if samples is not None:  # static: activation×activation MatMuls are quantized as well
        sensitivity |= dict.fromkeys(activation_matmuls(model), 0.0)
    if result.backend == "openvino":
        from kiln.backends.openvino_quant import quantize_nncf_int8

        return (
            sensitivity,
            lambda m, kept: quantize_nncf_int8(m, samples, kept, transformer=not conv),
            "static QDQ (NNCF)",
        )
    if samples is not None:
        return (
            sensitivity,
            lambda m, kept: quantize_static_int8(m, samples, kept, accuracy.method),
            f"static QDQ ({accuracy.method})",
        )
    return sensitivity, quantize_dynamic_int8, "dynamic"


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
    precision_options: PrecisionOptions | None = None,
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
        precision_options=precision_options,
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
