"""Load a model from a path or `zoo:NAME`, refusing bad files with one clear line each.

Every check here runs before any engine sees the file, so a hostile or broken model never
reaches ONNX Runtime and never leaves anything behind: Kiln's own checks first (they name the
problem and the fix), then the ONNX checker (graph structure: single assignment, topological
order, every input defined, tensor sizes, op schemas), then reading it into onnx_ir.
"""

from __future__ import annotations

import codecs
import hashlib
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir

from kiln.errors import KilnError, ModelError

# Opsets beyond what the installed onnx knows cannot be checked or run reliably.
MAX_OPSET = onnx.defs.onnx_opset_version()
MIN_OPSET = 7
IN_MEMORY_LIMIT = 1 << 30  # external weights smaller than this are read into memory
EXTERNAL_KEYS = {"location", "offset", "length", "checksum", "basepath"}
KNOWN_DOMAINS = {"", "ai.onnx", "com.microsoft", "ai.onnx.ml", "com.microsoft.nchwc"}
KNOWN_TYPES = set(onnx.TensorProto.DataType.values()) - {onnx.TensorProto.UNDEFINED}
FOUR_BIT = {
    getattr(onnx.TensorProto, name)
    for name in ("INT4", "UINT4", "FLOAT4E2M1")
    if hasattr(onnx.TensorProto, name)
}
REEXPORT = "Re-export the model."
STANDARD_OPS = "Re-export the model with standard ONNX operators."
REDOWNLOAD = "Re-export or re-download it."
PT2_SUFFIX = ".pt2"  # torch.export.save; kiln.compiler reads it through kiln.frontend


@dataclass
class Example:
    """Inputs a model came with and the outputs its own framework computed on them (a PyTorch
    module's, before export): what the artifact is checked against besides the exported graph."""

    framework: str  # "torch"
    feeds: dict[str, np.ndarray]  # by the model's input names
    outputs: list[np.ndarray]  # in the order of the model's outputs


@dataclass
class LoadedModel:
    """A validated model and where it came from."""

    model: ir.Model
    source: str  # what the user typed: a path or zoo:NAME
    name: str  # a short name for the artifact and reports
    fingerprint: str  # sha256 of the serialized graph, weights included
    example: Example | None = None  # a framework's own inputs and outputs (kiln.frontend)


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
    if path.suffix == PT2_SUFFIX:
        raise KilnError(
            f"{source}: is a saved torch.export program, not an ONNX model. Compile it first "
            f"(`kiln optimize {source}`), then use the artifact."
        )
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
            raise ModelError(f"{source}: is empty, not an ONNX model.", REDOWNLOAD)
        if _looks_like_text(head):
            raise ModelError(
                f"{source}: is a text file, not an ONNX model.",
                "Give the binary .onnx file your exporter wrote.",
            )
        raise ModelError(
            f"{source}: is not a valid ONNX model (the protobuf is truncated, corrupted or "
            "of another format).",
            REDOWNLOAD,
        )
    stem = path.name[: -len(".onnx")] if path.name.endswith(".onnx") else path.stem
    return proto, stem, path.parent


def load_model(source: str) -> LoadedModel:
    """Load, validate and fingerprint a model given as a path or `zoo:NAME`."""
    proto, name, base_dir = resolve_source(source)
    check_proto(proto, source, None if base_dir is None else Path(source))
    if base_dir is None:
        model, print_ = _read_ir(source, lambda: ir.serde.deserialize_model(proto))
    else:
        model, print_ = _read_ir(source, lambda: _load_file(source, proto))
    return LoadedModel(model=model, source=source, name=name, fingerprint=print_)


def read_checked(path: Path, where: str) -> ir.Model:
    """A model file with every check `load_model` makes, its weights left on disk: for files
    Kiln wrote itself (an artifact's model), which may still have been damaged since."""
    proto, _, _ = resolve_source(str(path))
    check_proto(proto, where, path)
    return _read_ir(where, lambda: ir.load(path))[0]


def check_proto(proto: onnx.ModelProto, source: str, path: Path | None) -> None:
    """Every check a model passes before anything reads it further; `path` is the model's file,
    beside which its external data must live (None: a model in memory)."""
    _check_opsets(proto, source)
    _check_ops(proto, source)
    if path is not None:
        _check_external_data(proto, path.parent, source)
    _check_structure(proto, source, path)
    _check_interface(proto, source)
    _check_input_sizes(proto, source)


def _load_file(source: str, proto: onnx.ModelProto) -> ir.Model:
    model = ir.load(source)
    if _external_bytes(proto) < IN_MEMORY_LIMIT:
        # Weights in memory survive the copies the pipeline makes; only really large models
        # keep reading from their external files.
        model = ir.external_data.load_to_model(model)
    return model


def _read_ir(source: str, read: Callable[[], ir.Model]) -> tuple[ir.Model, str]:
    """The model in onnx_ir, and its fingerprint. A model the checker passed may still be one
    onnx_ir cannot represent (a map-typed input) or whose weights do not fit their shapes."""
    try:
        model = read()
        return model, fingerprint(model)
    except (ir.serde.SerdeError, ValueError, TypeError, NotImplementedError, OSError) as exc:
        raise ModelError(
            f"{source}: Kiln cannot read this model ({_root_cause(exc)}).",
            "Re-export it with standard ONNX types and operators.",
        ) from None


def _root_cause(exc: BaseException) -> str:
    """onnx_ir wraps the real error in one SerdeError per level of the graph; the innermost
    one says what is wrong."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    text = " ".join(str(exc).split()).removesuffix(".")
    return text.split(" Please contribute")[0].removesuffix(".") or type(exc).__name__


IN_MEMORY = "<in-memory model>"


def load_any(
    model: str | os.PathLike | onnx.ModelProto | ir.Model,
    source: str = IN_MEMORY,
    name: str | None = None,
) -> LoadedModel:
    """`load_model` for a path or `zoo:NAME`; an in-memory onnx.ModelProto or onnx_ir.Model
    gets the same checks and is copied, so the caller's object is never modified. `source` and
    `name` say what an in-memory model is called in messages and in the artifact."""
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
        raise KilnError(f"{source}: the ModelProto has no graph.")
    check_proto(proto, source, None)
    copy, print_ = _read_ir(source, lambda: ir.serde.deserialize_model(proto))
    name = "".join(c if c.isalnum() or c in "-_." else "_" for c in name or proto.graph.name)
    return LoadedModel(model=copy, source=source, name=name or "model", fingerprint=print_)


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


def _check_structure(proto: onnx.ModelProto, source: str, path: Path | None) -> None:
    """The ONNX checker: what ONNX itself requires of a graph. A model file is checked from
    disk, so that its external data is found beside it."""
    try:
        if _shapeless(proto):
            onnx.checker.check_model(_as_checker_wants(proto))
        elif path is None:
            onnx.checker.check_model(proto)
        else:
            onnx.checker.check_model(str(path))
    except onnx.checker.ValidationError as exc:
        detail = " ".join(str(exc).split()).removesuffix(".")
        raise ModelError(
            f"{source}: is not a valid ONNX model: {detail}.",
            "Re-export it (onnx.checker shows the same).",
        ) from None
    except UnicodeError:
        raise ModelError(
            f"{source}: is not a valid ONNX model: a name or string in it is not UTF-8 text; "
            "the file is corrupted.",
            REDOWNLOAD,
        ) from None


def _shapeless(proto: onnx.ModelProto) -> list[onnx.ValueInfoProto]:
    """Tensors of the main graph declared without a shape: ONNX Runtime runs them (their rank
    is unknown), the checker wants a shape field."""
    graph = proto.graph
    return [
        value
        for value in [*graph.input, *graph.output, *graph.value_info]
        if value.type.HasField("tensor_type") and not value.type.tensor_type.HasField("shape")
    ]


def _as_checker_wants(proto: onnx.ModelProto) -> onnx.ModelProto:
    """A copy for the checker alone: each shapeless tensor given an empty shape, and external
    weights (already checked, see `_check_external_data`) made empty tensors, since the
    checker would look for their files beside the current directory."""
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    for value in _shapeless(copy):
        value.type.tensor_type.shape.SetInParent()
    for tensor in _tensors(copy):
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            tensor.data_location = onnx.TensorProto.DEFAULT
            tensor.ClearField("external_data")
            tensor.ClearField("dims")
            tensor.dims.append(0)
    return copy


def _check_interface(proto: onnx.ModelProto, source: str) -> None:
    """Outputs to compute, and a type for every tensor: Kiln makes inputs of their type and
    compares outputs by it (the checker lets a graph without outputs, an undefined or unknown
    element type pass; ONNX Runtime then fails on them without naming the model)."""
    if not proto.graph.output:
        raise ModelError(f"{source}: the graph has no outputs; there is nothing to run.", REEXPORT)
    for graph in graphs(proto.graph):
        kinds = {"input": graph.input, "output": graph.output, "value": graph.value_info}
        for kind, values in kinds.items():
            for value in values:
                elem_type = value.type.tensor_type.elem_type
                if value.type.HasField("tensor_type") and elem_type not in KNOWN_TYPES:
                    raise ModelError(
                        f"{source}: {kind} '{_short(value.name)}' has no valid element type "
                        f"(elem_type {elem_type}).",
                        REEXPORT,
                    )
    for tensor in _tensors(proto):
        if tensor.data_type not in KNOWN_TYPES:
            raise ModelError(
                f"{source}: {_what(tensor)} has no valid data type (data_type {tensor.data_type}).",
                REEXPORT,
            )


def _check_input_sizes(proto: onnx.ModelProto, source: str) -> None:
    """Refuse an input no machine could hold (a corrupted dim such as 2^40): Kiln would have
    to make one to verify or profile the model."""
    weights = {t.name for t in proto.graph.initializer}
    memory = _physical_memory()
    for value in proto.graph.input:
        tensor = value.type.tensor_type
        if value.name in weights or not tensor.HasField("shape"):
            continue
        dims = list(tensor.shape.dim)
        itemsize = _itemsize(tensor.elem_type)
        if math.prod(max(d.dim_value, 1) for d in dims) * itemsize > memory:
            shape = "x".join(str(d.dim_value) if d.HasField("dim_value") else "?" for d in dims)
            raise ModelError(
                f"{source}: input '{_short(value.name)}' has shape {shape}, larger than this "
                f"machine's {memory / 2**30:.0f} GiB of memory; its dims are corrupted.",
                REEXPORT,
            )


def _physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _itemsize(elem_type: int) -> int:
    try:
        return max(onnx.helper.tensor_dtype_to_np_dtype(elem_type).itemsize, 1)
    except (KeyError, ValueError, TypeError):  # strings, 4-bit and undefined types
        return 1


def _nbytes(tensor: onnx.TensorProto) -> int | None:
    """The bytes a tensor's shape and type need (None: a type of no fixed size)."""
    count = math.prod(tensor.dims)
    if tensor.data_type in FOUR_BIT:
        return (count + 1) // 2
    if tensor.data_type not in KNOWN_TYPES or tensor.data_type == onnx.TensorProto.STRING:
        return None
    return count * _itemsize(tensor.data_type)


def _what(tensor: onnx.TensorProto) -> str:
    return f"weight '{_short(tensor.name)}'" if tensor.name else "a constant tensor"


def _check_opsets(proto: onnx.ModelProto, source: str) -> None:
    if not proto.opset_import:
        raise ModelError(
            f"{source}: declares no opsets (opset_import is empty); the file may be truncated.",
            REDOWNLOAD,
        )
    for opset in proto.opset_import:
        if opset.domain in ("", "ai.onnx"):
            if opset.version > MAX_OPSET:
                raise ModelError(
                    f"{source}: uses ONNX opset {opset.version}, newer than the {MAX_OPSET} "
                    "this Kiln supports.",
                    f"Re-export with opset <= {MAX_OPSET} or upgrade onnx.",
                )
            if opset.version < MIN_OPSET:
                raise ModelError(
                    f"{source}: uses ONNX opset {opset.version}; Kiln needs {MIN_OPSET} or newer.",
                    "Convert it with onnx.version_converter first.",
                )


def graphs(graph: onnx.GraphProto) -> Iterator[onnx.GraphProto]:
    """`graph` and every graph inside it (If branches, Loop and Scan bodies), depth first."""
    yield graph
    yield from _subgraphs(graph.node)


def _subgraphs(nodes):
    for node in nodes:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                yield from graphs(attr.g)
            for sub in attr.graphs:
                yield from graphs(sub)


def _tensors(proto: onnx.ModelProto):
    """Every tensor that may hold external data: weights, sparse weights, constant attributes."""
    every = [*graphs(proto.graph), *(g for f in proto.functions for g in _subgraphs(f.node))]
    for graph in every:
        yield from graph.initializer
        for sparse in graph.sparse_initializer:
            yield from (sparse.values, sparse.indices)
    nodes = [n for g in every for n in g.node] + [n for f in proto.functions for n in f.node]
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
    for graph in graphs(proto.graph):
        for node in graph.node:
            domain = node.domain or ""
            if (domain, node.op_type) in local_functions:
                continue
            known = domain in KNOWN_DOMAINS
            if domain in ("", "ai.onnx"):
                version = versions.get("", versions.get("ai.onnx", MAX_OPSET))
                known = onnx.defs.has(node.op_type, "") and _defined_at(node.op_type, version)
            if not known:
                node_name = _short(node.name or (node.output[0] if node.output else ""))
                op_type = _short(node.op_type)
                if domain in ("", "ai.onnx"):
                    raise ModelError(
                        f"{source}: node '{node_name}' uses operator '{op_type}', which is "
                        f"not in ONNX opset {version}.",
                        STANDARD_OPS,
                    )
                raise ModelError(
                    f"{source}: node '{node_name}' uses operator '{op_type}' from domain "
                    f"'{_short(domain)}', which no engine Kiln drives knows.",
                    STANDARD_OPS,
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
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            _check_external_tensor(tensor, base, base_dir, source)


def _check_external_tensor(
    tensor: onnx.TensorProto, base: Path, base_dir: Path, source: str
) -> None:
    info = {e.key: e.value for e in tensor.external_data}
    location = info.get("location", "")
    what = _what(tensor)
    keys = [e.key for e in tensor.external_data]
    if len(keys) != len(info):  # engines disagree on which of two entries counts
        raise ModelError(f"{source}: {what} gives its external data twice ({keys}).", REEXPORT)
    unknown = sorted(set(info) - EXTERNAL_KEYS)
    if unknown:  # ONNX Runtime refuses these; onnx_ir would ignore them with a warning
        raise ModelError(
            f"{source}: {what} has unknown external data key '{_short(unknown[0])}' (ONNX "
            f"knows {', '.join(sorted(EXTERNAL_KEYS))}); the file is corrupted.",
            REEXPORT,
        )
    if not location:
        raise ModelError(
            f"{source}: {what} is marked as external data but names no file.", REEXPORT
        )
    target = _external_file(base, location, what, source)
    if not target.exists():
        raise ModelError(
            f"{source}: {what} needs external data file '{location}', which does not "
            f"exist (looked for {base_dir / location}).",
            "Put it next to the model.",
        )
    if not target.is_file():
        raise ModelError(
            f"{source}: {what} needs external data file '{location}', which is not a file.",
            REEXPORT,
        )
    size = target.stat().st_size
    try:
        offset = int(info.get("offset", 0))
        length = int(info.get("length", size - offset))
    except ValueError:
        raise ModelError(
            f"{source}: {what} has a malformed external data offset or length.", REEXPORT
        ) from None
    if offset < 0 or length < 0 or offset + length > size:
        raise ModelError(
            f"{source}: {what} needs bytes {offset}..{offset + length} of external data "
            f"file '{location}', which has only {size}; the file is truncated.",
            REDOWNLOAD,
        )
    needed = _nbytes(tensor)
    if needed is not None and length < needed:
        raise ModelError(
            f"{source}: {what} has shape {list(tensor.dims)}, {needed} bytes, but its external "
            f"data in '{location}' holds {length}; the model is corrupted.",
            REEXPORT,
        )


def _external_file(base: Path, location: str, what: str, source: str) -> Path:
    """Where `location` points, refused outside the model's directory (links followed)."""
    try:
        target = (base / location).resolve()
        escapes = os.path.isabs(location) or not target.is_relative_to(base)
        target.exists()  # a name too long for the system fails here, not later
    except (OSError, ValueError) as exc:  # a NUL byte, a name too long
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ModelError(
            f"{source}: {what} points to external data '{_short(location)}', which cannot be "
            f"opened ({reason}).",
            REEXPORT,
        ) from None
    if escapes:
        raise ModelError(
            f"{source}: {what} points to external data '{_short(location)}' outside the "
            "model's directory; refusing to read it.",
            "Keep external data files next to the model.",
        )
    return target


def _short(text: str, limit: int = 80) -> str:
    text = text.encode("unicode_escape").decode("ascii")  # a NUL or newline, made visible
    return text if len(text) <= limit else text[:limit] + "..."


def _looks_like_text(head: bytes) -> bool:
    try:  # incremental: a character cut at the end of `head` is not an error
        text = codecs.getincrementaldecoder("utf-8")().decode(head)
    except UnicodeDecodeError:
        return False
    return all(c.isprintable() or c in "\t\r\n" for c in text)
