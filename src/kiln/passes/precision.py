"""Precision: int8 and int4 under an accuracy guard.

Kiln quantizes every Conv/MatMul/Gemm/Attention weight to int8 — dynamically for
MatMul-heavy models, statically (QDQ, calibrated) for Conv-heavy ones and for OpenVINO — or
MatMul weights to 4 bits, measures the task metric (see `kiln.verify.Budget`) on held-out
inputs, and if the budget is broken restores the layers that hurt most to fp32, most sensitive
first, until it holds. For dynamic int8 the
sensitivity is measured: each layer's own output error when only its input and weight are
quantized the way ONNX Runtime does it (uint8 per-tensor activations, int8 per-channel
weights), on real activations captured from the fp32 model. For static int8 it is the
per-channel weight error (block-wise for int4).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import _ir_utils

from kiln.backends import get_backend
from kiln.backends.ort import OrtOptions
from kiln.backends.ort_quant import quantize_dynamic_int8
from kiln.ir.provenance import ORIGIN_KEY, PASS_KEY, all_nodes, join_origins, origins_of

PASS_NAME = "quantize-int8"


def pass_name(precision: str) -> str:
    return f"quantize-{precision}"


@dataclass
class PrecisionPlan:
    """Which layers run quantized and which were kept in fp32, and why."""

    int8: list[str] = field(default_factory=list)  # the quantized layers (int8 or int4)
    fp32: dict[str, str] = field(default_factory=dict)  # node → reason
    sensitivity: dict[str, float] = field(default_factory=dict)
    precision: str = "int8"
    restored_to: str = "fp32"  # what a restored layer runs in (bf16 where the engine says so)

    def to_json(self) -> dict:
        nodes = dict.fromkeys(self.int8, self.precision)
        nodes.update({name: f"{self.restored_to} ({why})" for name, why in self.fp32.items()})
        return {"default": self.precision, "nodes": nodes}


def _weight(node: ir.Node) -> np.ndarray | None:
    if node.domain not in ("", "ai.onnx", "com.microsoft") or len(node.inputs) < 2:
        return None
    if node.op_type not in ("MatMul", "Gemm", "Attention", "Conv") or node.inputs[1] is None:
        return None
    if node.op_type == "Conv":
        weight = _ir_utils.get_numpy_value(node.inputs[1])
        # [out, in, k...] → [in·k, out]: columns are the output channels, as for MatMul.
        return None if weight is None else weight.reshape(weight.shape[0], -1).T
    weight = _ir_utils.get_numpy_value(node.inputs[1])
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
        and all(v is not None and _ir_utils.get_numpy_value(v) is None for v in n.inputs)
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


def quantize_guarded(
    model: ir.Model,
    sensitivity: dict[str, float],
    meets_budget: Callable[[ir.Model], tuple[bool, float]],
    say: Callable[[str], None] = lambda _m: None,
    quantize: Callable[[ir.Model, list[str]], ir.Model] = quantize_dynamic_int8,
    precision: str = "int8",
) -> tuple[ir.Model, PrecisionPlan, float]:
    """Quantize all; if the budget fails, find the layers that break it by measurement and
    keep those in fp32. Layers are taken least sensitive first (by the cheap estimate); the
    shortest prefix that fails together with the layers already accepted ends in a culprit,
    found by bisection (each culprit costs about log2(layers) quantizations). The estimate
    only orders the search: the budget itself decides who is restored. Past a bounded number
    of trials the layers not yet judged are kept in fp32. Returns the model, its plan and its
    metric; the plan quantizes nothing when no layer can stay quantized."""
    order = sorted(sensitivity, key=sensitivity.get)
    trials = 0

    def trial(quantized: list[str]) -> tuple[ir.Model, bool, float]:
        nonlocal trials
        trials += 1
        chosen = set(quantized)
        kept = [n for n in order if n not in chosen]
        candidate = quantize(model, kept)
        _stamp(model, candidate, pass_name(precision))
        ok, metric = meets_budget(candidate)
        say(f"{precision} with {len(kept)} layers kept in fp32: metric {metric:.4f}")
        return candidate, ok, metric

    limit = 8 + 4 * max(1, len(order)).bit_length()
    accepted: list[str] = []
    restored: dict[str, str] = {}
    rest = list(order)
    best = trial(rest)
    while rest and not best[1]:
        if trials >= limit:
            restored |= dict.fromkeys(rest, "restored: not judged within the search's bound")
            best, rest = trial(accepted), []
            break
        low, high = 0, len(rest)  # accepted+rest[:low] meets the budget; +rest[:high] fails
        while high - low > 1:
            middle = (low + high) // 2
            _, ok, _ = trial(accepted + rest[:middle])
            low, high = (middle, high) if ok else (low, middle)
        culprit = rest[high - 1]
        restored[culprit] = (
            f"restored: breaks the budget when quantized (estimated error "
            f"{sensitivity[culprit]:.2%})"
        )
        accepted += rest[: high - 1]
        rest = rest[high:]
        best = trial(accepted + rest)
        if best[1]:
            accepted += rest
    candidate, _ok, metric = best
    plan = PrecisionPlan(
        int8=[n for n in order if n not in restored],
        fp32=restored,
        sensitivity=sensitivity,
        precision=precision,
    )
    return candidate, plan, metric


def _stamp(before: ir.Model, after: ir.Model, name: str = PASS_NAME) -> None:
    """Nodes the quantizer made inherit the origins of the node they are named after (the
    quantized MatMul), or else of the nodes they are wired to (activation quantizers)."""
    known = {n.name: origins_of(n) for n in all_nodes(before.graph) if n.name}
    bare = [n for n in all_nodes(after.graph) if not origins_of(n)]
    for node in bare:
        name = node.name or ""
        prefix = max((k for k in known if name.startswith(k)), key=len, default=None)
        if prefix is not None:
            node.metadata_props[ORIGIN_KEY] = join_origins(known[prefix])
        node.metadata_props[PASS_KEY] = name
    for node in bare:
        if origins_of(node):
            continue
        wired = [v.producer() for v in node.inputs if v is not None and v.producer()]
        wired += [user for v in node.outputs for user, _ in v.uses()]
        found = set().union(*(origins_of(n) for n in wired if n is not None))
        node.metadata_props[ORIGIN_KEY] = join_origins(found)
