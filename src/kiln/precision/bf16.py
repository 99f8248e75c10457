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


def no_bf16_kernels(engine: str) -> str | None:
    """Why an engine's bf16 is no bf16 artifact on this CPU, before any build: OpenVINO on
    AVX-512 without AVX512_BF16 or AMX accepts the bf16 hint and emulates it — bf16's rounding
    at more than fp32's cost."""
    if engine != "openvino":
        return None
    from kiln.backends.openvino import cpu_runs_bf16

    if cpu_runs_bf16():
        return None
    return "openvino has no bf16 kernels on this CPU (they need AMX or AVX512_BF16)"


def bf16_plan(model: ir.Model, engine: str, executable: Any) -> dict[str, Any]:
    nodes = {n.name for n in model.graph}  # the engine also names layers it made itself
    kept = {
        name: f"fp32 (kept by {engine}: {kind})"
        for name, (precision, kind) in executable.layer_precisions().items()
        if precision == "f32" and name in nodes
    }
    return {"default": "bf16", "scheme": f"{engine} inference precision bf16", "nodes": kept}
