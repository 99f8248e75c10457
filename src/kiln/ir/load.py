"""Load a model from a path or `zoo:NAME`, refusing bad files with one clear line each.

Every check here runs before any engine sees the file, so a hostile or broken model never
reaches ONNX Runtime and never leaves anything behind.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError

from kiln.errors import KilnError

# Opsets beyond what the installed onnx knows cannot be checked or run reliably.
MAX_OPSET = onnx.defs.onnx_opset_version()
MIN_OPSET = 7
KNOWN_DOMAINS = {"", "ai.onnx", "com.microsoft", "ai.onnx.ml", "com.microsoft.nchwc"}


@dataclass
class LoadedModel:
    """A validated model and where it came from."""

    model: ir.Model
    source: str  # what the user typed: a path or zoo:NAME
    name: str  # a short name for the artifact and reports
    fingerprint: str  # sha256 of the serialized graph, weights included


def resolve_source(source: str) -> tuple[onnx.ModelProto, str, Path | None]:
    """Return (proto without external data, short name, base directory for external data)."""
    if source.startswith("zoo:"):
        from kiln import zoo

        name = source[4:]
        return zoo.build(name), name, None
    path = Path(source)
    if not path.exists():
        raise KilnError(f"{source}: no such file. Give a path to an .onnx file or zoo:NAME.")
    if path.is_dir():
        raise KilnError(f"{source}: is a directory, not an ONNX model file.")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except (DecodeError, RuntimeError, ValueError, OSError) as exc:
        raise KilnError(
            f"{source}: not a readable ONNX model (protobuf parse failed: "
            f"{_first_line(exc)}). Is the file truncated or of another format?"
        ) from None
    if not proto.HasField("graph") or (not proto.graph.node and not proto.graph.output):
        raise KilnError(f"{source}: not an ONNX model (no graph found in the file).")
    stem = path.name[: -len(".onnx")] if path.name.endswith(".onnx") else path.stem
    return proto, stem, path.parent


def load_model(source: str) -> LoadedModel:
    """Load, validate and fingerprint a model given as a path or `zoo:NAME`."""
    proto, name, base_dir = resolve_source(source)
    _check_opsets(proto, source)
    _check_ops(proto, source)
    if base_dir is not None:
        _check_external_data(proto, base_dir, source)
        model = ir.load(str(Path(source)))
    else:
        model = ir.serde.deserialize_model(proto)
    return LoadedModel(model=model, source=source, name=name, fingerprint=fingerprint(model))


def fingerprint(model: ir.Model) -> str:
    """sha256 of the model's graph and weights: identical models give identical prints."""
    digest = hashlib.sha256()
    digest.update(ir.serde.serialize_model(model).SerializeToString(deterministic=True))
    return digest.hexdigest()[:16]


def _check_opsets(proto: onnx.ModelProto, source: str) -> None:
    for opset in proto.opset_import:
        if opset.domain in ("", "ai.onnx"):
            if opset.version > MAX_OPSET:
                raise KilnError(
                    f"{source}: uses ONNX opset {opset.version}, newer than the {MAX_OPSET} "
                    f"this Kiln supports. Re-export with opset <= {MAX_OPSET} or upgrade onnx."
                )
            if opset.version < MIN_OPSET:
                raise KilnError(
                    f"{source}: uses ONNX opset {opset.version}; Kiln needs {MIN_OPSET} or newer. "
                    "Convert it with onnx.version_converter first."
                )


def _graphs(graph: onnx.GraphProto):
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(attr.g)
            for sub in attr.graphs:
                yield from _graphs(sub)


def _check_ops(proto: onnx.ModelProto, source: str) -> None:
    """Name the first op that no engine Kiln drives can run."""
    versions = {o.domain or "": o.version for o in proto.opset_import}
    local_functions = {(f.domain, f.name) for f in proto.functions}
    for graph in _graphs(proto.graph):
        for node in graph.node:
            domain = node.domain or ""
            if (domain, node.op_type) in local_functions:
                continue
            known = domain in KNOWN_DOMAINS
            if domain in ("", "ai.onnx"):
                version = versions.get("", versions.get("ai.onnx", MAX_OPSET))
                known = onnx.defs.has(node.op_type, "") and _defined_at(node.op_type, version)
            if not known:
                where = f"{domain}::{node.op_type}" if domain else node.op_type
                raise KilnError(
                    f"{source}: node '{node.name or node.output[0]}' uses operator {where}, "
                    "which neither ONNX nor ONNX Runtime defines. Replace it or register a "
                    "custom-op library."
                )


def _defined_at(op_type: str, version: int) -> bool:
    try:
        onnx.defs.get_schema(op_type, version, "")
    except onnx.defs.SchemaError:
        return False
    return True


def _check_external_data(proto: onnx.ModelProto, base_dir: Path, source: str) -> None:
    """Refuse external-data locations that escape the model's directory or are missing."""
    base = base_dir.resolve()
    for graph in _graphs(proto.graph):
        for tensor in graph.initializer:
            if tensor.data_location != onnx.TensorProto.EXTERNAL:
                continue
            location = next((e.value for e in tensor.external_data if e.key == "location"), "")
            target = (base / location).resolve()
            if os.path.isabs(location) or not target.is_relative_to(base):
                raise KilnError(
                    f"{source}: weight '{tensor.name}' points to external data '{location}' "
                    "outside the model's directory; refusing to read it. Keep external data "
                    "files next to the model."
                )
            if not target.is_file():
                raise KilnError(
                    f"{source}: weight '{tensor.name}' needs external data file '{location}', "
                    f"which is missing from {base_dir}."
                )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
