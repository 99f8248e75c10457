"""What makes two models alike for the tuner, and two machines the same class: a model's
signature (op-type mix, matrix FLOPs by class, parameters, dynamic dims) and a distance
between signatures; the hardware class is the CPU fingerprint (model, ISA, cores)."""

from __future__ import annotations

import hashlib
import math
from collections import Counter
from pathlib import Path
from typing import Any

import onnx_ir as ir

from kiln.cost import count_flops_by_op
from kiln.errors import KilnError
from kiln.hardware import cpu_info
from kiln.ir.inputs import default_dims, model_inputs, named_dims

CONV_OPS = {"Conv", "ConvTranspose", "QLinearConv", "ConvInteger", "FusedConv"}


def model_signature(model: ir.Model) -> dict[str, Any]:
    ops = Counter(node.op_type for node in model.graph)
    total = sum(ops.values()) or 1
    params = sum(
        math.prod(v.shape.dims) if v.shape is not None and v.shape.is_static() else 0
        for v in model.graph.initializers.values()
    )
    try:
        by_op = count_flops_by_op(ir.serde.serialize_model(model), default_dims(model))
    except KilnError:
        by_op = {}
    conv = sum(f for op, f in by_op.items() if op in CONV_OPS)
    return {
        "ops": {op: count / total for op, count in sorted(ops.items())},
        "nodes": total,
        "flops": {"conv": conv, "matmul": sum(by_op.values()) - conv},
        "parameters": int(params),
        "dynamic_dims": sorted(
            {name for v in model_inputs(model).values() for _, name in named_dims(v)}
        ),
    }


def distance(a: dict[str, Any], b: dict[str, Any]) -> float:
    """0 for the same model; the op mix weighs most (0..2), then the size of the work and of
    the weights (a quarter per decade)."""
    ops = set(a["ops"]) | set(b["ops"])
    mix = sum(abs(a["ops"].get(o, 0.0) - b["ops"].get(o, 0.0)) for o in ops)
    flops = _decades(sum(a["flops"].values()), sum(b["flops"].values()))
    params = _decades(a["parameters"], b["parameters"])
    return mix + 0.25 * flops + 0.25 * params


def _decades(x: float, y: float) -> float:
    return abs(math.log10(max(x, 1)) - math.log10(max(y, 1)))


def hardware() -> dict[str, Any]:
    """This machine's class (the key records are kept under) and what it is."""
    cpu = cpu_info()
    return {
        "class": cpu.fingerprint,
        "cpu": cpu.model,
        "cores": cpu.logical_cores,
        "features": list(cpu.features),
    }


def check_signature(signature: dict[str, Any]) -> str | None:
    """What is wrong with a signature `distance` would read (as `model_signature` makes it),
    or None: records imported from elsewhere are checked before a warm start meets them."""
    ops, flops = signature.get("ops"), signature.get("flops")
    if not isinstance(ops, dict) or not all(
        isinstance(k, str) and _number(v) for k, v in ops.items()
    ):
        return "needs 'ops': an object of op type → share of nodes"
    if not isinstance(flops, dict) or not all(_number(flops.get(k)) for k in ("conv", "matmul")):
        return "needs 'flops': an object with numbers 'conv' and 'matmul'"
    if not all(_number(v) for v in flops.values()):
        return "needs 'flops' to hold numbers only"
    if not _number(signature.get("parameters")):
        return "needs 'parameters': a number"
    return None


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def content_digest(source: str) -> str:
    """`-` and 8 hex digits of the SHA-256 of a model file (an artifact: its manifest, which
    names its source's fingerprint); "" for a zoo model, whose name is its content."""
    path = Path(source)
    target = path / "manifest.json" if path.is_dir() else path
    if not target.is_file():
        return ""
    with target.open("rb") as file:
        return f"-{hashlib.file_digest(file, 'sha256').hexdigest()[:8]}"
