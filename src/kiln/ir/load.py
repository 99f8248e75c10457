"""Load a model from a path or `zoo:NAME`, refusing bad files with one clear line each.

Every check here runs before any engine sees the file, so a hostile or broken model never
reaches ONNX Runtime and never leaves anything behind.
"""

from __future__ import annotations

import codecs
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnx_ir as ir

from kiln.errors import KilnError

# Opsets beyond what the installed onnx knows cannot be checked or run reliably.
MAX_OPSET = onnx.defs.onnx_opset_version()
MIN_OPSET = 7
IN_MEMORY_LIMIT = 1 << 30  # external weights smaller than this are read into memory
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
        raise KilnError(f"{source}: is a directory, not an ONNX model file. Give the .onnx file.")
    try:
        with path.open("rb") as file:
            head = file.read(4096)
        proto = onnx.load(str(path), load_external_data=False) if head else None
    except OSError as exc:
        raise KilnError(f"{source}: cannot read the file ({exc.strerror or exc}).") from None
    except Exception:  # whatever the parser raises, these bytes are not a model
        proto = None
    if proto is None or not proto.HasField("graph"):
        if not head:
            raise KilnError(f"{source}: is empty, not an ONNX model. Re-export or re-download it.")
        if _looks_like_text(head):
            raise KilnError(
                f"{source}: is a text file, not an ONNX model. Give the binary .onnx file "
                "your exporter wrote."
            )
        raise KilnError(
            f"{source}: is not a valid ONNX model (the protobuf is truncated, corrupted or "
            "of another format). Re-export or re-download it."
        )
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
        if _external_bytes(proto) < IN_MEMORY_LIMIT:
            # Weights in memory survive the copies the pipeline makes; only really large
            # models keep reading from their external files.
            model = ir.external_data.load_to_model(model)
    else:
        model = ir.serde.deserialize_model(proto)
    return LoadedModel(model=model, source=source, name=name, fingerprint=fingerprint(model))


IN_MEMORY = "<in-memory model>"


def load_any(model: str | os.PathLike | onnx.ModelProto | ir.Model) -> LoadedModel:
    """`load_model` for a path or `zoo:NAME`; an in-memory onnx.ModelProto or onnx_ir.Model
    gets the same checks and is copied, so the caller's object is never modified."""
    if isinstance(model, str | os.PathLike):
        return load_model(str(model))
    if isinstance(model, ir.Model):
        proto = ir.serde.serialize_model(model)
    elif isinstance(model, onnx.ModelProto):
        proto = model
    else:
        raise KilnError(
            f"cannot compile a {type(model).__name__}: give a path to an .onnx file, zoo:NAME, "
            "an onnx.ModelProto or an onnx_ir.Model."
        )
    if not proto.HasField("graph"):
        raise KilnError(f"{IN_MEMORY}: the ModelProto has no graph.")
    _check_opsets(proto, IN_MEMORY)
    _check_ops(proto, IN_MEMORY)
    copy = ir.serde.deserialize_model(proto)
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in proto.graph.name) or "model"
    return LoadedModel(model=copy, source=IN_MEMORY, name=name, fingerprint=fingerprint(copy))


def _external_bytes(proto: onnx.ModelProto) -> int:
    total = 0
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "length" and entry.value.isdigit():
                total += int(entry.value)
    return total


def fingerprint(model: ir.Model) -> str:
    """sha256 of the model's graph and weights: identical models give identical prints."""
    digest = hashlib.sha256()
    digest.update(ir.serde.serialize_model(model).SerializeToString(deterministic=True))
    return digest.hexdigest()[:16]


def _check_opsets(proto: onnx.ModelProto, source: str) -> None:
    if not proto.opset_import:
        raise KilnError(
            f"{source}: declares no opsets (opset_import is empty); the file may be truncated. "
            "Re-export or re-download it."
        )
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
    yield from _subgraphs(graph.node)


def _subgraphs(nodes):
    for node in nodes:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from _graphs(attr.g)
            for sub in attr.graphs:
                yield from _graphs(sub)


def _tensors(proto: onnx.ModelProto):
    """Every tensor that may hold external data: weights, sparse weights, constant attributes."""
    graphs = [*_graphs(proto.graph), *(g for f in proto.functions for g in _subgraphs(f.node))]
    for graph in graphs:
        yield from graph.initializer
        for sparse in graph.sparse_initializer:
            yield from (sparse.values, sparse.indices)
    nodes = [n for g in graphs for n in g.node] + [n for f in proto.functions for n in f.node]
    for node in nodes:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("sparse_tensor"):
                yield from (attr.sparse_tensor.values, attr.sparse_tensor.indices)


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
                node_name = node.name or node.output[0]
                if domain in ("", "ai.onnx"):
                    raise KilnError(
                        f"{source}: node '{node_name}' uses operator '{node.op_type}', which is "
                        f"not in ONNX opset {version}. Re-export the model with standard ONNX "
                        "operators."
                    )
                raise KilnError(
                    f"{source}: node '{node_name}' uses operator '{node.op_type}' from domain "
                    f"'{domain}', which no engine Kiln drives knows. Re-export the model with "
                    "standard ONNX operators."
                )


def _defined_at(op_type: str, version: int) -> bool:
    try:
        onnx.defs.get_schema(op_type, version, "")
    except onnx.defs.SchemaError:
        return False
    return True


def _check_external_data(proto: onnx.ModelProto, base_dir: Path, source: str) -> None:
    """Refuse external data that escapes the model's directory, is missing or is too short."""
    base = base_dir.resolve()
    for tensor in _tensors(proto):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in tensor.external_data}
        location = info.get("location", "")
        what = f"weight '{tensor.name}'" if tensor.name else "a constant tensor"
        if not location:
            raise KilnError(
                f"{source}: {what} is marked as external data but names no file. "
                "Re-export the model."
            )
        target = (base / location).resolve()
        if os.path.isabs(location) or not target.is_relative_to(base):
            raise KilnError(
                f"{source}: {what} points to external data '{location}' outside the model's "
                "directory; refusing to read it. Keep external data files next to the model."
            )
        if not target.is_file():
            raise KilnError(
                f"{source}: {what} needs external data file '{location}', which does not "
                f"exist (looked for {base_dir / location}). Put it next to the model."
            )
        try:
            offset = int(info.get("offset", 0))
            length = int(info.get("length", target.stat().st_size - offset))
        except ValueError:
            raise KilnError(
                f"{source}: {what} has a malformed external data offset or length. "
                "Re-export the model."
            ) from None
        size = target.stat().st_size
        if offset < 0 or length < 0 or offset + length > size:
            raise KilnError(
                f"{source}: {what} needs bytes {offset}..{offset + length} of external data "
                f"file '{location}', which has only {size}; the file is truncated. Re-export "
                "or re-download it."
            )


def _looks_like_text(head: bytes) -> bool:
    try:  # incremental: a character cut at the end of `head` is not an error
        text = codecs.getincrementaldecoder("utf-8")().decode(head)
    except UnicodeDecodeError:
        return False
    return all(c.isprintable() or c in "\t\r\n" for c in text)
