"""What a session says about its model, in the forms users already read: ONNX Runtime's
(`get_inputs()`, `get_outputs()`, `get_modelmeta()`, `get_providers()`) and KServe v2's (the
server's model metadata). Read from the graph's declared interface: no weights, no engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import onnx_ir as ir

from kiln.wire import KSERVE_TYPES

# ONNX Runtime reports a model without a model_version as this (INT64_MAX).
_NO_VERSION = 2**63 - 1


@dataclass(frozen=True)
class NodeArg:
    """An input or output as onnxruntime.NodeArg describes it: `type` like "tensor(float)",
    `shape` with fixed dims as ints, symbolic dims by name and unknown ones as None."""

    name: str
    type: str
    shape: list[int | str | None]


@dataclass(frozen=True)
class ModelMetadata:
    """The model's metadata, field for field as onnxruntime.ModelMetadata."""

    producer_name: str
    graph_name: str
    domain: str
    description: str
    graph_description: str
    version: int
    custom_metadata_map: dict[str, str] = field(default_factory=dict)


def graph_inputs(model: ir.Model) -> list[ir.Value]:
    """The inputs a caller feeds: initializers listed as inputs (old exporters) are not."""
    return [v for v in model.graph.inputs if v.name not in model.graph.initializers]


def node_arg(value: ir.Value) -> NodeArg:
    return NodeArg(value.name or "", _type_text(value.type, value.dtype), _shape(value.shape))


def _type_text(kind: ir.TypeProtocol | None, dtype: ir.DataType | None) -> str:
    """ONNX Runtime's text for a type: tensor(int64), seq(tensor(float)), optional(...)."""
    if isinstance(kind, ir.SequenceType):
        return f"seq({_type_text(kind.elem_type, None)})"
    if isinstance(kind, ir.OptionalType):
        return f"optional({_type_text(kind.elem_type, None)})"
    if isinstance(kind, ir.SparseTensorType):
        return f"sparse_tensor({kind.dtype.name.lower()})"
    dtype = kind.dtype if kind is not None else dtype
    return f"tensor({dtype.name.lower()})" if dtype is not None else "tensor(undefined)"


def _shape(shape: ir.Shape | None) -> list[int | str | None]:
    """ONNX Runtime's form: [] for a value declared without a shape."""
    out: list[int | str | None] = []
    for dim in shape or []:
        if isinstance(dim, int):
            out.append(dim if dim >= 0 else None)
        else:
            out.append(str(dim.value) if dim.value is not None else None)
    return out


def model_metadata(model: ir.Model) -> ModelMetadata:
    return ModelMetadata(
        producer_name=model.producer_name or "",
        graph_name=model.graph.name or "",
        domain=model.domain or "",
        description=model.doc_string or "",
        graph_description=model.graph.doc_string or "",
        version=model.model_version if model.model_version is not None else _NO_VERSION,
        custom_metadata_map=dict(model.metadata_props),
    )


def kserve_meta(value: ir.Value) -> dict[str, Any]:
    """{name, datatype (KServe), shape (-1 dynamic)}."""
    dtype = KSERVE_TYPES.get(value.dtype.name, value.dtype.name) if value.dtype else "BYTES"
    shape = [d if isinstance(d, int) and d >= 0 else -1 for d in (value.shape or [-1])]
    return {"name": value.name, "datatype": dtype, "shape": shape}


def providers_of(executable: Any, backend: str) -> list[str]:
    """The engine's providers for this executable, in ONNX Runtime's form (the Executable
    contract's `providers`; `backend` is kept for callers)."""
    return list(executable.providers)
