"""bf16 is the engine's decision layer by layer: the plan records the layers it kept in fp32,
read back from the engine's own compiled model (never what Kiln asked for)."""

from __future__ import annotations

from typing import Any

import onnx_ir as ir


def bf16_refusal(engine: str, executable: Any) -> str | None:
    """Why the executable is not a bf16 one, or None: an engine without bf16 kernels on this
    CPU falls back to fp32 silently, and such an artifact must not be labelled bf16."""
    actual = getattr(executable, "precision", "bf16")
    if actual == "bf16":
        return None
    return (
        f"{engine} computes in {actual} on this CPU, not bf16 (its bf16 kernels need AMX or "
        "AVX512_BF16)"
    )


def bf16_plan(model: ir.Model, engine: str, executable: Any) -> dict[str, Any]:
    nodes = {n.name for n in model.graph}  # the engine also names layers it made itself
    kept = {
        name: f"fp32 (kept by {engine}: {kind})"
        for name, (precision, kind) in executable.layer_precisions().items()
        if precision == "f32" and name in nodes
    }
    return {"default": "bf16", "scheme": f"{engine} inference precision bf16", "nodes": kept}
