"""`manifest.json`: what an artifact is and how it was made, as typed data.

Format 2 adds `config` (the CompileConfig that rebuilds the artifact); format 1 manifests are
still read, their config reconstructed from the backend and precision they record.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx_ir as ir

from kiln import __version__
from kiln.config import CompileConfig
from kiln.errors import KilnError
from kiln.hardware import cpu_info
from kiln.verify import Verification

FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
PARTS_BACKEND = "parts"  # the backend a partitioned artifact's manifest names


@dataclass
class SourceInfo:
    """The original model: its short name, where to find it again, its fingerprint."""

    name: str
    path: str
    fingerprint: str


@dataclass
class HardwareInfo:
    fingerprint: str
    cpu: str
    features: list[str] = field(default_factory=list)


@dataclass
class BackendInfo:
    """The engine and the exact settings the artifact runs with."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class PassRecord:
    name: str
    rewrites: int
    nodes_created: int
    note: str = ""  # why the pass left the model alone, where a measurement decided


@dataclass
class Manifest:
    kiln_version: str
    created: str
    source: SourceInfo
    hardware: HardwareInfo
    config: CompileConfig
    backend: BackendInfo
    passes: list[PassRecord]
    dropped_passes: list[str]
    nodes: dict[str, int]  # {"before": n, "after": m}
    precision: dict[str, Any]  # {"default", "nodes": {node: precision (why)}, "scheme", ...}
    inputs: list[dict[str, Any]]  # {name, dtype, shape} with dim names kept
    outputs: list[dict[str, Any]]
    dims: dict[str, int]  # the values synthesized inputs give each named dim
    verification: Verification | None
    buckets: dict[str, list[int]] = field(default_factory=dict)
    benchmark: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)  # options given and not used, and why
    # A partitioned artifact's parts (kiln.artifact.parts.PartsSection as JSON); its backend
    # is then PARTS_BACKEND, each part recording its own.
    parts: dict[str, Any] | None = None
    # One part of a `kiln split` (kiln.split): its role (edge or server), the cut, the
    # codec, the boundary tensors, the prediction — what `kiln.Session(remote=...)` checks.
    split: dict[str, Any] | None = None
    format_version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data = {"format_version": self.format_version, **data}
        data["config"] = self.config.to_json()
        for key in ("source", "hardware", "backend"):
            data[key] = dataclasses.asdict(data[key])
        data["passes"] = [dataclasses.asdict(p) for p in self.passes]
        data["verification"] = self.verification.to_json() if self.verification else None
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any], where: str = "manifest.json") -> Manifest:
        version = data.get("format_version")
        if version not in READABLE_FORMATS:
            raise KilnError(
                f"{where}: artifact format {version}, this Kiln reads formats "
                f"{', '.join(map(str, READABLE_FORMATS))}. Rebuild it with kiln optimize."
            )
        try:
            manifest = cls._parse(data, version)
            if manifest.parts is None:
                _check_backend(manifest.backend)
        except KilnError as exc:
            raise KilnError(f"{where}: {exc} Rebuild it with kiln optimize.") from None
        except (KeyError, TypeError, AttributeError, ValueError) as exc:
            raise KilnError(
                f"{where}: corrupted manifest ({type(exc).__name__}: {exc}). "
                "Rebuild it with kiln optimize."
            ) from None
        return manifest

    @classmethod
    def _parse(cls, data: dict[str, Any], version: int) -> Manifest:
        backend = BackendInfo(**data["backend"])
        precision = dict(data.get("precision") or {"default": "fp32", "nodes": {}})
        if version == 1:  # no recorded config: the engine and precision it ran are the config
            config = CompileConfig(engine=backend.name, precision=precision.get("default", "fp32"))
        else:
            config = CompileConfig.from_json(data["config"])
        verification = data.get("verification")
        return cls(
            kiln_version=data["kiln_version"],
            created=data["created"],
            source=SourceInfo(**data["source"]),
            hardware=HardwareInfo(**data["hardware"]),
            config=config,
            backend=backend,
            passes=[PassRecord(**p) for p in data.get("passes", [])],
            dropped_passes=list(data.get("dropped_passes", [])),
            nodes=dict(data.get("nodes") or {}),
            precision=precision,
            inputs=list(data.get("inputs", [])),
            outputs=list(data.get("outputs", [])),
            dims=dict(data.get("dims") or {}),
            verification=Verification.from_json(verification) if verification else None,
            buckets=dict(data.get("buckets") or {}),
            benchmark=data.get("benchmark"),
            notes=[str(n) for n in data.get("notes") or []],
            parts=data.get("parts") or None,
            split=data.get("split") or None,
            format_version=FORMAT_VERSION,
        )


def _check_backend(backend: BackendInfo) -> None:
    """The recorded engine exists and its recorded options are ones it has."""
    from kiln.backends import OPTIONS, options_from_json

    if backend.name not in OPTIONS:
        raise KilnError(
            f"the manifest names backend '{backend.name}'; this Kiln has {', '.join(OPTIONS)}."
        )
    try:
        options_from_json(backend.name, backend.options)
    except TypeError as exc:
        raise KilnError(f"the manifest's {backend.name} options are not valid ({exc}).") from None


def new_manifest(
    *,
    source: SourceInfo,
    model: ir.Model,
    config: CompileConfig,
    backend: BackendInfo,
    passes: list[PassRecord],
    dropped_passes: list[str],
    nodes: dict[str, int],
    precision: dict[str, Any],
    dims: dict[str, int],
    verification: Verification | None,
    benchmark: dict[str, Any] | None = None,
    notes: list[str] | None = None,
    buckets: dict[str, list[int]] | None = None,
) -> Manifest:
    """A manifest for `model` as compiled now, on this machine."""
    cpu = cpu_info()
    return Manifest(
        kiln_version=__version__,
        created=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        source=source,
        hardware=HardwareInfo(cpu.fingerprint, cpu.model, list(cpu.features)),
        config=config,
        backend=backend,
        passes=passes,
        dropped_passes=dropped_passes,
        nodes=nodes,
        precision=precision,
        inputs=[_spec(v) for v in model.graph.inputs],
        outputs=[_spec(v) for v in model.graph.outputs],
        dims=dims,
        verification=verification,
        benchmark=benchmark,
        notes=list(notes or []),
        buckets=dict(buckets or {}),
    )


def source_path(source: str) -> str:
    """Where to find the original again later (kiln bench reloads it): zoo names stay."""
    if source.startswith("zoo:") or source.startswith("<"):
        return source
    return str(Path(source).resolve())


def _spec(value: ir.Value) -> dict[str, Any]:
    return {
        "name": value.name,
        "dtype": value.dtype.numpy().name if value.dtype is not None else None,
        "shape": [d if isinstance(d, int) else str(d.value) for d in (value.shape or [])],
    }
