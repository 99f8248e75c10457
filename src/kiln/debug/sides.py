"""The two things `kiln compare` sets side by side, each as a graph, an engine and its settings.

A side is one of:

* an original model (`model.onnx`, `zoo:NAME`): it runs as-is, in ONNX Runtime at basic
  optimisation and fp32 — the reference every compile is verified against;
* an artifact (`NAME.kiln/`): its `model.onnx` on its recorded engine and options, its
  `provenance.json` mapping each compiled node to the original nodes and passes;
* `MODEL@ENGINE[:PRECISION]` (`model.onnx@openvino:bf16`, `zoo:bert-tiny@ort:int8`): MODEL
  compiled in memory by `kiln.compiler.build`, exactly as `kiln optimize` would build it.

Each side also knows its original graph — the names the comparison is written in — unless that
was an artifact whose original is gone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx_ir as ir

from kiln.errors import KilnError

Say = Callable[[str], None]
DEFAULT_PRECISION = "fp32"


@dataclass
class Side:
    """One model ready to run: the graph the engine is given and how it got there."""

    spec: str  # what the user typed
    kind: str  # "model", "artifact" or "build"
    model: ir.Model  # the graph the engine runs (nodes all named)
    engine: str
    options: Any
    precision: str  # the precision the side was built for: fp32, bf16, int8, int4
    original: ir.Model | None  # the original graph; None: an artifact whose original is gone
    # compiled node → {"origin": [original nodes], "passes": [...]}; None: it is the original
    provenance: dict[str, dict[str, Any]] | None = None
    plan: dict[str, str] = field(default_factory=dict)  # compiled node → its precision, and why
    missing: str | None = None  # why the original is not there (artifacts only)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # an artifact's --shape
    dims: dict[str, int] = field(default_factory=dict)  # an artifact's fitted dims (manifest)
    notes: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.spec} ({self.engine} {self.precision})"

    def describe(self) -> dict[str, Any]:
        """The side in JSON: what it is and how it runs."""
        return {
            "spec": self.spec,
            "kind": self.kind,
            "engine": self.engine,
            "precision": self.precision,
            "options": self.options.to_json(),
            "nodes": sum(1 for _ in self.model.graph),
        }

    def producer(self, tensor: str) -> ir.Node | None:
        return _producers(self.model).get(tensor)

    def origin(self, node: ir.Node) -> dict[str, Any]:
        """The original nodes and passes behind one of this side's nodes."""
        if self.provenance is None:
            return {"origin": [node.name], "passes": []}
        entry = self.provenance.get(node.name or "", {})
        return {"origin": entry.get("origin") or [node.name], "passes": entry.get("passes") or []}

    def precision_of(self, node: ir.Node) -> str:
        """The precision `node` computes in, from the side's precision plan: the plan names
        the node before quantization (`mm2`), the quantizer names its pieces after it
        (`mm2_quant`, `mm2_quant_output_scale_mul`)."""
        name = node.name or ""
        key = max((k for k in self.plan if name.startswith(k)), key=len, default=None)
        if key is None:  # a piece named after its tensor (logits_DequantizeLinear ← fc)
            key = next((o for o in sorted(self.origin(node)["origin"]) if o in self.plan), None)
        if key is not None:
            return str(self.plan[key]).split(" ", 1)[0]
        return _base_precision(self)


def _base_precision(side: Side) -> str:
    """What a node outside the plan computes in: fp32, or bf16 where the engine was told to."""
    if getattr(side.options, "inference_precision", None) == "bf16":
        return "bf16"
    return DEFAULT_PRECISION if side.precision in ("int8", "int4") else side.precision


def _producers(model: ir.Model) -> dict[str, ir.Node]:
    return {v.name: node for node in model.graph for v in node.outputs if v.name}


def synthesized_feeds(
    original: ir.Model,
    sides: tuple[Side | None, ...],
    shapes: dict[str, tuple[int, ...]] | None,
    seed: int = 0,
    say: Say = lambda _msg: None,
) -> tuple[dict[str, Any], str]:
    """Inputs synthesized for the original graph at an artifact's recorded dims, fitted as
    `kiln optimize` fits them where the model leaves a dim or a scalar to guess; and what to
    call them."""
    from kiln.compiler.reference import SYNTHESIZED, fit_original
    from kiln.ir.inputs import default_dims, synthesize
    from kiln.ir.ladder import FIRST_GUESS

    dims = default_dims(original)
    for side in reversed([s for s in sides if s is not None]):  # the first side's win
        dims |= side.dims
    fit = fit_original(original, shapes, say, dims)
    feeds = synthesize(original, dims, seed=seed, shapes=fit.shapes, scalars=fit.scalars)
    return feeds, SYNTHESIZED if fit.label == FIRST_GUESS else f"{SYNTHESIZED} ({fit.label})"


def load_side(
    spec: str,
    *,
    inputs: str | None = None,
    shapes: dict[str, tuple[int, ...]] | None = None,
    say: Say = lambda _msg: None,
) -> Side:
    """Open one side of a comparison (see the module docstring)."""
    if Path(spec).is_dir():
        return _artifact_side(spec)
    model, engine, precision = split_spec(spec)
    if engine is None:
        return _model_side(spec)
    return _built_side(spec, model, engine, precision, inputs, shapes, say)


def split_spec(spec: str) -> tuple[str, str | None, str]:
    """`MODEL@ENGINE[:PRECISION]` → (MODEL, ENGINE, PRECISION); a plain model → (spec, None,
    fp32). A path that exists is a path, even with an '@' in it."""
    if "@" not in spec or Path(spec).exists():
        return spec, None, DEFAULT_PRECISION
    model, _, target = spec.rpartition("@")
    engine, _, precision = target.partition(":")
    from kiln.config import ENGINES, PRECISIONS

    if not model or engine not in ENGINES or (precision and precision not in PRECISIONS):
        raise KilnError(
            f"{spec}: expected MODEL@ENGINE:PRECISION with ENGINE one of {', '.join(ENGINES)} "
            f"and PRECISION one of {', '.join(PRECISIONS)}, e.g. model.onnx@openvino:bf16."
        )
    return model, engine, precision or DEFAULT_PRECISION


def _model_side(spec: str) -> Side:
    from kiln.compiler.api import load_source
    from kiln.compiler.reference import REFERENCE_OPTIONS
    from kiln.ir import stamp_origins

    model = load_source(spec).model
    stamp_origins(model)  # unnamed nodes get names: rows and provenance need them
    return Side(spec, "model", model, "ort", REFERENCE_OPTIONS, DEFAULT_PRECISION, model)


def _artifact_side(spec: str) -> Side:
    from kiln.artifact import read_artifact
    from kiln.backends import get_backend, options_from_json

    artifact = read_artifact(spec)
    manifest = artifact.manifest
    engine = manifest.backend.name
    get_backend(engine)
    original, missing, notes = _artifact_original(spec, manifest.source)
    return Side(
        spec=spec,
        kind="artifact",
        model=ir.load(str(artifact.model_path)),  # weights stay on disk until the engine reads
        engine=engine,
        options=options_from_json(engine, manifest.backend.options),
        precision=str(manifest.precision.get("default", manifest.config.precision)),
        original=original,
        provenance=artifact.provenance(),
        plan={str(k): str(v) for k, v in (manifest.precision.get("nodes") or {}).items()},
        missing=missing,
        shapes=dict(manifest.config.shapes),
        dims=dict(manifest.dims),
        notes=notes,
    )


def _artifact_original(spec: str, source: Any) -> tuple[ir.Model | None, str | None, list[str]]:
    """The model an artifact was compiled from, found again where the manifest says; None and
    why when it is gone (moved, deleted, or an in-memory model that never had a file). A
    saved torch.export program (.pt2) is exported again, as it was when compiled."""
    from kiln.compiler.api import load_source
    from kiln.ir import stamp_origins

    where = str(source.path)
    if where.startswith("<"):
        return None, f"{spec} was compiled from an in-memory model, which has no file", []
    if not where.startswith("zoo:") and not Path(where).is_file():
        return None, f"{spec} was compiled from {where}, which is gone", []
    loaded = load_source(where)
    notes = []
    if loaded.fingerprint != source.fingerprint:
        notes.append(f"{where} has changed since {spec} was compiled from it")
    stamp_origins(loaded.model)
    return loaded.model, None, notes


def _built_side(
    spec: str,
    source: str,
    engine: str,
    precision: str,
    inputs: str | None,
    shapes: dict[str, tuple[int, ...]] | None,
    say: Say,
) -> Side:
    from kiln.artifact import provenance_map
    from kiln.compiler import CompileConfig, build
    from kiln.compiler.api import load_source

    if Path(source).is_dir():
        raise KilnError(
            f"{spec}: MODEL@ENGINE compiles an original model (.onnx or zoo:NAME), not an "
            f"artifact; compare the artifact itself: kiln compare ... {source}"
        )
    _check_target(spec, engine, precision)
    loaded = load_source(source)
    config = CompileConfig(engine=engine, precision=precision, inputs=inputs, shapes=shapes or {})
    say(f"compiling {source} for {engine}/{precision}")
    result, _ = build(loaded, config, progress=say)
    notes = []
    if not result.ok:  # compared all the same: finding where it breaks is the point
        notes.append(f"{spec} does not verify: {result.verification.summary()}")
    plan = (result.plan or {}).get("nodes") or {}
    return Side(
        spec=spec,
        kind="build",
        model=result.model,
        engine=engine,
        options=result.options,
        precision=precision,
        original=loaded.model,  # stamped by the compile, and left unchanged by it
        provenance=provenance_map(result.model),
        plan={str(k): str(v) for k, v in plan.items()},
        notes=notes,
    )


def _check_target(spec: str, engine: str, precision: str) -> None:
    """Refused before compiling: a precision the engine does not run here, and bf16 on a CPU
    without bf16 kernels (OpenVINO would compute in fp32, and the comparison would be of fp32
    against fp32 under a bf16 label)."""
    from kiln.precision import ENGINES_FOR

    if engine not in ENGINES_FOR[precision]:
        engines = " or ".join(f"@{e}:{precision}" for e in ENGINES_FOR[precision])
        raise KilnError(f"{spec}: {engine} does not run {precision} here; use {engines}.")
    if precision != "bf16":
        return
    from kiln.backends.openvino import cpu_runs_bf16

    if not cpu_runs_bf16():
        model = spec.rpartition("@")[0]
        raise KilnError(
            f"{spec}: this CPU has no bf16 kernels (OpenVINO's need AMX or AVX512_BF16), so "
            f"it would compute in fp32; compare {model}@openvino:fp32 or {model}@ort:int8 here."
        )
