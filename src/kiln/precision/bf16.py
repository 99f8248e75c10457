"""bf16 is the engine's decision layer by layer: the plan records the layers it kept in fp32,
read back from the engine's own compiled model (never what Kiln asked for)."""

from __future__ import annotations

from typing import Any

import onnx_ir as ir


def bf16_plan(model: ir.Model, engine: str, executable: Any) -> dict[str, Any]:
    nodes = {n.name for n in model.graph}  # the engine also names layers it made itself
    kept = {
        name: f"fp32 (kept by {engine}: {kind})"
        for name, (precision, kind) in executable.layer_precisions().items()
        if precision == "f32" and name in nodes
    }
    return {"default": "bf16", "scheme": f"{engine} inference precision bf16", "nodes": kept}
