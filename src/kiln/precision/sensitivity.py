"""How much each layer suffers from quantization: cheap estimates that order the guard's search.

For dynamic int8 the error is measured on real activations captured from the fp32 model: each
layer's own output error when only its input and weight are quantized the way ONNX Runtime does
it (uint8 per-tensor activations, int8 per-channel weights). For static int8 it is the
per-channel weight error (block-wise for int4): activation ranges are calibrated, so the weight
is what varies from layer to layer.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from kiln.backends import get_backend
from kiln.backends.ort import OrtOptions
from kiln.ir.onnxscript_internals import get_numpy_value


def _weight(node: ir.Node) -> np.ndarray | None:
    if node.domain not in ("", "ai.onnx", "com.microsoft") or len(node.inputs) < 2:
        return None
    if node.op_type not in ("MatMul", "Gemm", "Attention", "Conv") or node.inputs[1] is None:
        return None
    if node.op_type == "Conv":
        weight = get_numpy_value(node.inputs[1])
        # [out, in, k...] → [in·k, out]: columns are the output channels, as for MatMul.
        return None if weight is None else weight.reshape(weight.shape[0], -1).T
    weight = get_numpy_value(node.inputs[1])
    if weight is None or weight.ndim != 2:
        return None
    if node.op_type == "Gemm" and node.attributes.get_int("transB", 0):
        weight = weight.T
    return weight


def quantizable(model: ir.Model) -> dict[str, ir.Node]:
    return {n.name: n for n in model.graph if _weight(n) is not None}


def activation_matmuls(model: ir.Model) -> list[str]:
    """MatMuls of two computed tensors (attention's QK and AV): static int8 quantizes them
    too, so the guard must be able to restore them."""
    return [
        n.name
        for n in model.graph
        if n.op_type == "MatMul"
        and n.domain in ("", "ai.onnx")
        and all(v is not None and get_numpy_value(v) is None for v in n.inputs)
    ]


def conv_heavy(model: ir.Model) -> bool:
    """Static QDQ int8 suits Conv-heavy models, dynamic int8 MatMul-heavy ones; which kind
    holds most of the weights decides (no shapes needed, unlike a FLOP count)."""
    sizes = {"conv": 0, "matmul": 0}
    for node in quantizable(model).values():
        weight = node.inputs[1].const_value
        sizes["conv" if node.op_type == "Conv" else "matmul"] += weight.size if weight else 0
    return sizes["conv"] > sizes["matmul"]


def _fake_quantized_matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x·w with x as uint8 per tensor (DynamicQuantizeLinear) and w as int8 per column."""
    low, high = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    scale = (high - low) / 255 or 1.0
    zero = np.clip(np.round(-low / scale), 0, 255)
    xq = (np.clip(np.round(x / scale) + zero, 0, 255) - zero) * scale
    wscale = np.abs(w).max(axis=0) / 127
    wscale[wscale == 0] = 1.0
    wq = np.clip(np.round(w / wscale), -127, 127) * wscale
    return xq.astype(np.float32) @ wq.astype(np.float32)


def _fake_quantized_weight(w: np.ndarray, bits: int, block: int | None) -> np.ndarray:
    """Symmetric per-column quantization, in blocks of `block` rows when given (int4)."""
    top = 2 ** (bits - 1) - 1
    rows = w.shape[0]
    size = block or rows
    pad = (-rows) % size
    blocks = np.pad(w, ((0, pad), (0, 0))).reshape(-1, size, w.shape[1])
    scale = np.abs(blocks).max(axis=1, keepdims=True) / top
    scale[scale == 0] = 1.0
    return (np.clip(np.round(blocks / scale), -top, top) * scale).reshape(-1, w.shape[1])[:rows]


def weight_sensitivity(
    model: ir.Model, bits: int = 8, block: int | None = None, ops: tuple[str, ...] = ()
) -> dict[str, float]:
    """Per quantizable node (of `ops`, when given), the relative error of its weight under
    per-channel int8 — for layers whose activations are calibrated statically (their ranges
    are fixed, so the weight is what varies from layer to layer) — or block-wise int4."""
    errors = {}
    for name, node in quantizable(model).items():
        if ops and node.op_type not in ops:
            continue
        w = _weight(node)
        wq = _fake_quantized_weight(w, bits, block)
        errors[name] = float(np.linalg.norm(wq - w) / (np.linalg.norm(w) or 1.0))
    return errors


def layer_sensitivity(model: ir.Model, feeds: dict[str, np.ndarray]) -> dict[str, float]:
    """Per quantizable node, ‖x̃·w̃ − x·w‖ / ‖x·w‖ on the activations it really sees."""
    nodes = {n: node for n, node in quantizable(model).items() if node.op_type != "Conv"}
    probe = ir.serde.deserialize_model(ir.serde.serialize_model(model))
    wanted = {}
    for node in probe.graph:
        if node.name in nodes:
            value = node.inputs[0]
            wanted[node.name] = value.name
            if value not in probe.graph.outputs and value not in probe.graph.inputs:
                probe.graph.outputs.append(value)
    exe = get_backend("ort").compile(probe, OrtOptions(optimization="basic"))
    values = dict(zip(exe.output_names, exe.run(feeds), strict=True)) | feeds
    errors = {}
    for name, node in nodes.items():
        x, w = values[wanted[name]].astype(np.float32), _weight(node)
        x = x.reshape(-1, x.shape[-1])
        exact = x @ w
        errors[name] = float(
            np.linalg.norm(_fake_quantized_matmul(x, w) - exact) / (np.linalg.norm(exact) or 1.0)
        )
    return errors
