"""What OpenVINO's runtime model says about each layer it executed: the original ONNX layers
fused into it, its place in the execution order, the precision it ran in and the bytes it
moved. The profile's kernel records carry it (`OpenVinoKernelRecord`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kiln.backends.base import KernelRecord

if TYPE_CHECKING:
    import openvino as ov


@dataclass(frozen=True)
class OpenVinoKernelRecord(KernelRecord):
    """A kernel record with what OpenVINO's runtime model says about the layer."""

    # place in the execution order (execOrder): the same in every compile of one model with
    # one configuration, unlike the names of the layers OpenVINO creates
    order: int | None = None
    # what it computed in (runtimePrecision): "fp32", "bf16", "fp16", "int8"
    precision: str | None = None
    # its inputs (weights included) and outputs at the element types it ran with: the bytes
    # an int8 kernel moves are int8, not the fp32 of the QDQ graph it came from
    bytes: int | None = None


@dataclass(frozen=True)
class Layer:
    """One executed layer of a runtime model (see `executed_layers`)."""

    origin: tuple[str, ...]
    order: int | None = None
    precision: str | None = None
    bytes: int | None = None


# OpenVINO's runtimePrecision → the names the roofline uses; integer kernels (u8 activations,
# i8 weights) run on the int8 roof.
_RUNTIME_PRECISIONS = {"f32": "fp32", "bf16": "bf16", "f16": "fp16", "u8": "int8", "i8": "int8"}


def executed_layers(compiled: ov.CompiledModel) -> dict[str, Layer]:
    """Executed layer name → the original layers OpenVINO fused into it (the link from a
    kernel record back to the ONNX nodes), its execution order, runtime precision and bytes
    moved, read from the runtime model's rt_info (a Reorder OpenVINO inserted has no
    original layers)."""
    out = {}
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        if "originalLayersNames" not in info:
            continue
        names = _rt_text(info, "originalLayersNames") or ""
        order = _rt_text(info, "execOrder")
        precision = _rt_text(info, "runtimePrecision")
        out[op.get_friendly_name()] = Layer(
            origin=tuple(n for n in names.split(",") if n),
            order=int(order) if order and order.lstrip("-").isdigit() else None,
            precision=_RUNTIME_PRECISIONS.get(precision or "", "fp32"),
            bytes=_moved_bytes(op),
        )
    return out


def _rt_text(info: Any, key: str) -> str | None:
    return str(info[key].astype(str)) if key in info else None


def _moved_bytes(op: Any) -> int | None:
    """Bytes of a runtime layer's inputs (weights included: they are Const inputs) and
    outputs at the element types it ran with; None when a shape is dynamic."""
    ports = [*(i.get_source_output() for i in op.inputs()), *op.outputs()]
    total = 0
    for port in ports:
        shape = port.get_partial_shape()
        if shape.is_dynamic:
            return None
        total += int(np.prod(shape.to_shape(), dtype=np.int64)) * port.get_element_type().bitwidth
    return total // 8
