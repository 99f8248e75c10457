"""How a session opens what it runs: an artifact directory (NAME.kiln, run with the engine and
settings its manifest records), a plain .onnx file or zoo:NAME (as-is, ONNX Runtime unless
another backend is asked for), resolved into a `Source`; and the engine options that follow."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx_ir as ir

from kiln.artifact import Artifact, read_artifact
from kiln.backends import default_options, options_from_json
from kiln.errors import KilnError
from kiln.home import kiln_home, replace_directory


@dataclass(frozen=True)
class Source:
    """What a session runs, resolved from what the user gave."""

    where: str  # as the user gave it: every message names it
    backend: str
    options: dict[str, Any]  # the engine settings recorded (artifact) or the engine's defaults
    interface: ir.Model  # inputs and outputs for checks; weights are not needed from it
    model_path: str  # the file every executable compiles from
    buckets: dict[str, list[int]]  # recorded in the artifact; empty for a plain model
    precision: str  # what the artifact's precision plan runs; "fp32" for a plain model
    artifact: Artifact | None


@dataclass(frozen=True)
class _Recorded:
    """The part of an artifact's manifest a session runs by."""

    backend: str
    options: dict[str, Any]
    buckets: dict[str, list[int]]
    precision: str


def open_source(path_or_model: str | Path, backend: str | None) -> Source:
    source = str(path_or_model)
    if Path(source).is_dir() or source.endswith(".kiln"):
        return _from_artifact(source, backend)
    return _from_model(source, backend)


def _from_artifact(source: str, backend: str | None) -> Source:
    artifact = read_artifact(source)
    recorded = _recorded(artifact)
    if backend not in (None, recorded.backend):
        raise KilnError(
            f"{source}: built for backend '{recorded.backend}', it cannot run on "
            f"'{backend}'. Build another artifact with --backend {backend}."
        )
    model_path = str(artifact.model_path)
    return Source(
        where=source,
        backend=recorded.backend,
        options=recorded.options,
        # ir.load leaves external weights on disk: only the interface is read from it.
        interface=ir.load(model_path),
        model_path=model_path,
        buckets=recorded.buckets,
        precision=recorded.precision,
        artifact=artifact,
    )


def _recorded(artifact: Artifact) -> _Recorded:
    """The one place the runtime reads a manifest: engine, its options, buckets, precision."""
    manifest = artifact.manifest
    precision = manifest.precision
    return _Recorded(
        backend=manifest.backend.name,
        options=dict(manifest.backend.options),
        buckets=dict(manifest.buckets or {}),
        precision=str(precision.get("default", "fp32")) if isinstance(precision, dict) else "fp32",
    )


def _from_model(source: str, backend: str | None) -> Source:
    from kiln.ir.load import load_model  # the validating loader: only plain models need it

    loaded = load_model(source)
    backend = backend or "ort"  # as-is on ONNX Runtime unless asked otherwise
    return Source(
        where=source,
        backend=backend,
        options=default_options(backend).to_json(),  # fp32 on every engine
        interface=loaded.model,
        model_path=_on_disk(loaded) if source.startswith("zoo:") else source,
        buckets={},
        precision="fp32",
        artifact=None,
    )


def _on_disk(loaded: Any) -> str:
    """A zoo model written once under KILN_HOME (atomically: temp dir, then rename), so that
    each bucket compiles from a file instead of re-serialising the model."""
    target = kiln_home() / "models" / f"{loaded.name}-{loaded.fingerprint[:16]}"
    if not (target / "model.onnx").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        # A directory, not one file: the model and its external data appear together. Two
        # processes racing write the same model; the one that renames last wins.
        try:
            replace_directory(target, lambda tmp: _save(loaded.model, tmp))
        except OSError:
            if not (target / "model.onnx").is_file():  # lost no race: a real failure
                raise
    return str(target / "model.onnx")


def _save(model: ir.Model, directory: Path) -> None:
    ir.save(model, directory / "model.onnx", external_data="model.onnx.data")


def engine_options(source: Source, overrides: dict[str, Any] | None) -> dict[str, Any]:
    """The source's engine options with the user's `overrides` on top; an unknown key is
    refused, naming the options the engine has."""
    if overrides is not None and not isinstance(overrides, dict):
        raise KilnError(
            f"{source.where}: options must be a dict of backend options, got {overrides!r}."
        )
    options = options_from_json(source.backend, source.options).to_json()
    unknown = sorted(set(overrides or {}) - set(options))
    if unknown:
        raise KilnError(
            f"{source.where}: unknown option '{unknown[0]}' for backend '{source.backend}'; "
            f"its options are {sorted(options)}."
        )
    options.update(overrides or {})
    if source.backend == "openvino" and not options.get("cache_dir"):
        # OpenVINO keys its cache by model and shape: one directory serves every bucket.
        # OPTIMIZE_SIZE keeps the weights out of the cache (1 MB per bucket of BERT-base
        # instead of 440 MB); they are read from the model file.
        options["cache_dir"] = str(kiln_home() / "openvino-cache")
        options["extra"] = {"CACHE_MODE": "OPTIMIZE_SIZE", **options["extra"]}
    return options


def run_precision(source: Source, options: dict[str, Any]) -> str:
    """The precision the session computes in: padding checks and swap verification use its
    tolerance."""
    if source.backend == "openvino" and options.get("inference_precision") != "f32":
        return "bf16"  # OpenVINO's own choice on CPUs that have bf16
    return source.precision
