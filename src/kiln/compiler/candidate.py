"""One compile of one concrete CompileConfig: load → passes → precision → verify.

The original is the reference (ONNX Runtime, basic optimisation, fp32); the pass stage runs the
pipeline verified at the config's precision (fp32 for int8/int4, whose precision stage then
quantizes the verified fp32 model under the accuracy guard). A hand recipe (config.recipe) runs
no passes and quantizes the original as the engine's own tool does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import onnx_ir as ir

from kiln.backends import default_options, options_from_json
from kiln.compiler.passes_stage import Target, run_passes, verify_on
from kiln.compiler.reference import (
    engine_noise,
    fit_inputs,
    reference_executable,
    reference_feeds,
    run_reference,
)
from kiln.compiler.unused_options import unused_options
from kiln.config import HAND, CompileConfig
from kiln.errors import KilnError
from kiln.ir import stamp_origins
from kiln.ir.inputs import feed_dims
from kiln.ir.ladder import FIRST_GUESS, Guess
from kiln.ir.load import LoadedModel
from kiln.passes import KilnPass, PassReport, PassSpec, default_pipeline, run_pipeline
from kiln.passes.fused_op_pays import SKIP_LAYERNORM_FUSION, skip_layernorm_slower
from kiln.passes.gemm_as_matmul import GemmToMatMulPass
from kiln.passes.simplify import count_nodes
from kiln.precision import (
    QUANTIZED,
    Calibration,
    Recipe,
    bf16_plan,
    bf16_refusal,
    calibration_for,
    check_precision,
    is_static,
    no_bf16_kernels,
    pass_name,
    quantize_under_budget,
    resolve_recipe,
)
from kiln.verify import Verification

Say = Callable[[str], None]
Feeds = dict[str, np.ndarray]


@dataclass
class CompileResult:
    """Everything one candidate's compile learned."""

    loaded: LoadedModel
    config: CompileConfig  # concrete: no "auto"
    model: ir.Model
    reports: list[PassReport]
    verification: Verification | None
    options: Any  # the engine's options the artifact runs with
    dropped: list[str] = field(default_factory=list)
    nodes_before: int = 0
    feeds: list[Feeds] = field(default_factory=list)
    reference: list[list[np.ndarray]] = field(default_factory=list)  # the original's outputs
    plan: dict | None = None  # per-node precision, when not all fp32
    notes: list[str] = field(default_factory=list)  # what was used and what was not
    memory: dict | None = None  # under a memory budget: what was measured (compiler.memory)

    @property
    def backend(self) -> str:
        return self.config.engine

    @property
    def precision(self) -> str:
        return self.config.precision

    @property
    def label(self) -> str:
        """`ort/int8`; a hand recipe `openvino/int8 hand:nncf-transformer`, with `+guard`
        when it met the budget only with layers the guard kept in fp32."""
        recipe = (self.plan or {}).get("recipe") or {}
        return config_label(self.config) + ("+guard" if recipe.get("guard") else "")

    @property
    def ok(self) -> bool:
        return self.verification is None or self.verification.ok


def config_label(config: CompileConfig) -> str:
    """A candidate's name in reports and --json: engine/precision, "static" where OpenVINO
    is compiled for the verified dims, and the hand recipe or "original graph" (no pass ran)."""
    label = f"{config.engine}/{config.precision}" + (" static" if config.static else "")
    if config.recipe is None:
        return f"{label} original graph" if config.pipeline == () else label
    return f"{label} hand" if config.recipe == HAND else f"{label} hand:{config.recipe}"


def engine_options(engine: str, precision: str, overrides: dict[str, Any]) -> Any:
    """The engine's settings for `precision` with the config's overrides applied."""
    defaults = default_options(engine, precision)
    if not overrides:
        return defaults
    try:
        return options_from_json(engine, {**defaults.to_json(), **overrides})
    except TypeError:
        known = ", ".join(sorted(defaults.to_json()))
        raise KilnError(
            f"unknown option among {sorted(overrides)} for engine '{engine}'; its options are "
            f"{known}."
        ) from None


def _measured(options: Any, config: CompileConfig, model: ir.Model) -> Any:
    """The engine's options with what was measured here: for ORT, its own SkipLayerNormFusion
    left out where that fused kernel is slower than its parts (kiln.passes.fused_op_pays),
    unless the config names the optimizers to leave out itself."""
    if config.engine != "ort" or "disabled_optimizers" in config.engine_options:
        return options
    if SKIP_LAYERNORM_FUSION in options.disabled_optimizers or not skip_layernorm_slower(model):
        return options
    disabled = (*options.disabled_optimizers, SKIP_LAYERNORM_FUSION)
    return replace(options, disabled_optimizers=disabled)


def resolve_pipeline(names: tuple[str, ...] | None, engine: str) -> list[PassSpec]:
    """Pass names → the passes (the engine's default pipeline when None)."""
    default = default_pipeline(engine=engine)
    if names is None:
        return default
    every = {s.name: s for s in default_pipeline(engine="ort") + default_pipeline("openvino")}
    for name in names:
        if name not in every:
            raise KilnError(f"unknown pass '{name}' in the pipeline; see --show-pipeline.")
    engines_ok = [n for n in names if every[n].engines is None or engine in every[n].engines]
    return [every[n] for n in engines_ok]


def compile_candidate(
    loaded: LoadedModel,
    config: CompileConfig,
    given: list[Feeds] | None = None,
    given_source: str = "given inputs",
    pipeline: list[PassSpec] | None = None,
    say: Say = lambda _m: None,
) -> CompileResult:
    """Compile `loaded` under one concrete config; `given` are the user's reference inputs
    (already read and checked). Never writes anything."""
    engine, precision = config.engine, config.precision
    check_precision(engine, precision)
    original = loaded.model
    stamp_origins(original)
    nodes_before = count_nodes(original)
    quantized = precision in QUANTIZED
    if quantized and not config.verify:
        raise KilnError(f"{precision} is only written verified: the accuracy guard measures it.")
    specs = pipeline if pipeline is not None else resolve_pipeline(config.pipeline, engine)
    given_qdq = is_prequantized(original)  # QDQ from quantization-aware training: kept as is
    recipe = _recipe(loaded, config, given_qdq)
    if recipe is not None:  # the recipe's own graph: the original, every pass off
        config, specs = config.replace(recipe=recipe.name), []
    static = quantized and (
        given_qdq or (recipe.static if recipe else is_static(original, precision, engine))
    )
    if static or given_qdq:  # the quantizers know standard ops only; the engines fuse QDQ
        specs = [s for s in specs if s.engines is None]  # graphs themselves
    if precision == "int4":  # a Gemm hides its weight from the 4-bit quantizer (MatMul only)
        specs = [s for s in specs if s.name != "fuse-gemm"]
    reference = reference_executable(original) if config.verify else None
    fit = Guess(dict(config.shapes))
    if reference is not None and not given:
        fit = fit_inputs(reference, original, dict(config.shapes), say)
    calibration = Calibration()
    if quantized and not given_qdq:
        first = given[0] if given else None
        calibration = calibration_for(
            original, static, config.calib, config.calib_method, first, given_source, fit,
        )  # fmt: skip
    target = _target(original, config, "fp32" if quantized else precision, given, given_source,
                     calibration, (reference, fit), say)  # fmt: skip
    built = run_passes(original, specs, target, say)
    result = CompileResult(
        loaded=loaded,
        config=config.replace(pipeline=tuple(s.name for s in specs)),
        model=built.model,
        reports=built.reports,
        verification=built.verification,
        options=target.options,
        dropped=built.dropped,
        nodes_before=nodes_before,
        feeds=target.feeds,
        reference=target.reference,
        notes=unused_options(config, static)
        + _fit_notes(fit)
        + _calibration_notes(calibration)
        + built.notes,
    )
    if precision == "bf16" and result.ok:
        executable = built.executable or _compile(result)
        result.plan = bf16_plan(result.model, engine, executable)
        refusal = no_bf16_kernels(engine) or bf16_refusal(engine, executable)
        if refusal:
            raise KilnError(
                f"{loaded.source}: no bf16 artifact: {refusal}. Nothing was written; use "
                "--precision fp32 or int8."
            )
    if quantized and given_qdq and result.ok:
        result.plan = {"default": precision, "nodes": {}, "scheme": "QDQ given in the model"}
    elif quantized and result.ok:
        _quantize(result, calibration, target, recipe, say)
    return result


def _recipe(loaded: LoadedModel, config: CompileConfig, given_qdq: bool) -> Recipe | None:
    """The config's hand recipe resolved for this model (None: Kiln's own compile)."""
    if config.recipe is None:
        return None
    if given_qdq:
        raise KilnError(
            f"{loaded.source} is already quantized (QDQ): hand recipe '{config.recipe}' "
            "quantizes fp32 models; compile it without a recipe."
        )
    return resolve_recipe(config.recipe, loaded.model, config.engine, config.precision)


def is_prequantized(model: ir.Model) -> bool:
    """The model already holds QuantizeLinear/DequantizeLinear pairs (quantization-aware
    training): int8 keeps them rather than quantizing again."""
    return any(node.op_type == "QuantizeLinear" for node in model.graph)


def _fit_notes(fit: Guess) -> list[str]:
    if fit.label == FIRST_GUESS:
        return []
    return [f"the original runs on synthesized inputs only at {fit.label}, found by trying"]


def _calibration_notes(calibration: Calibration) -> list[str]:
    note = calibration.note or {}
    return [note[key] for key in ("summary", "shortened") if key in note]


def _target(
    original: ir.Model,
    config: CompileConfig,
    precision: str,
    given: list[Feeds] | None,
    given_source: str,
    calibration: Calibration,
    reference: tuple[Any, Guess],
    say: Say,
) -> Target:
    options = _measured(engine_options(config.engine, precision, dict(config.engine_options)),
                        config, original)  # fmt: skip
    target = Target(config.engine, options, precision, [], [], "none", verify=config.verify)
    if not config.verify:
        return target
    held_out = calibration.held_out
    exe, fit = reference
    feeds, source = reference_feeds(
        original,
        held_out or given,
        "held-out calibration samples" if held_out else given_source,
        fit,
    )
    say("running the original in ONNX Runtime (reference)")
    target.feeds, target.source = feeds, source
    target.options = options = _specialized(options, config, original, feeds[0])
    target.reference = run_reference(exe, feeds, source)
    target.noise = engine_noise(original, feeds, target.reference, config.engine, options)
    target.budget = config.budget()
    return target


def _specialized(options: Any, config: CompileConfig, model: ir.Model, feeds: Feeds) -> Any:
    """`options` compiled static at the dims of `feeds` where the config says `static`."""
    if not config.static:
        return options
    return replace(options, dim_overrides=feed_dims(model, feeds))


def _quantize(
    result: CompileResult,
    calibration: Calibration,
    target: Target,
    recipe: Recipe | None,
    say: Say,
) -> None:
    """The precision stage, handed a check that compiles and verifies on the target engine."""
    config = result.config
    options = engine_options(config.engine, config.precision, dict(config.engine_options))
    options = _measured(options, config, result.loaded.model)
    if target.feeds:
        options = _specialized(options, config, result.loaded.model, target.feeds[0])
    check_target = Target(
        config.engine, options, config.precision, target.feeds, target.reference,
        target.source, budget=target.budget,
    )  # fmt: skip
    if config.precision == "int4":  # a Linear exported as Gemm: its weight as a MatMul's
        result.reports += run_pipeline(result.model, [_spec(GemmToMatMulPass)])
    quantized = quantize_under_budget(
        result.model,
        config.precision,
        config.engine,
        calibration=calibration,
        feeds=target.feeds[0],
        method=config.calib_method,
        block_size=config.block_size,
        check=lambda candidate: verify_on(candidate, check_target)[0],
        restored_to="bf16" if getattr(options, "inference_precision", None) == "bf16" else "fp32",
        recipe=recipe,
        say=say,
    )
    if quantized.verification is None:  # nothing to quantize: not an accuracy failure
        other = "int8 or fp32" if config.precision == "int4" else "fp32"
        raise KilnError(
            f"{result.loaded.source}: {quantized.error}, so there is no {config.precision} "
            f"artifact to build. Nothing was written; use --precision {other}."
        )
    result.options, result.plan = options, quantized.plan
    result.model = quantized.model
    result.verification = quantized.verification or Verification(
        False, config.precision, target.source, []
    )
    if quantized.error:
        result.verification.ok = False
        result.verification.error = quantized.error
        return
    result.reports.append(
        PassReport(
            pass_name(config.precision), "precision", quantized.quantized, 0,
            count_nodes(result.model), 0.0,
        )
    )  # fmt: skip


def _spec(make: type[KilnPass]) -> PassSpec:
    return PassSpec(make.name, make.stage, make, make.summary, make.engines)


def _compile(result: CompileResult) -> Any:
    from kiln.backends import get_backend

    return get_backend(result.backend).compile(result.model, result.options)
