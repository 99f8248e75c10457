"""Name the attention, LayerNorm and GELU blocks a compiled model still computes op by op,
and the check that kept each from fusing.

After the fuse stage, every Softmax, ReduceMean that starts a LayerNorm written out (mean,
subtract, square, mean, add eps, sqrt, divide) and Erf or Tanh (a GELU written out) left is
the trace of a block no rule took. The rules that would have taken it are tried again at the
nodes just below it with the rewriter's tracer, and the best partial match's failure reason
is the one reported.
"""

from __future__ import annotations

import ast
from collections.abc import Callable

import onnx_ir as ir
from onnxscript.rewriter import pattern
from onnxscript.rewriter.pattern import MatchingTracer

from kiln.ir import onnxscript_internals as internals
from kiln.passes.probed_attention import probed_attention_rules
from kiln.passes.tanh_gelu import tanh_gelu_rules

HOPS = 8  # how far below the leftover op a block's root may be


def _gelu_rules() -> list[pattern.RewriteRule]:
    from onnxscript.rewriter.ort_fusions import erfgelu, gelu

    return [*erfgelu.rules.rules, *gelu.gelu_rules.rules, *tanh_gelu_rules.rules]


KINDS: dict[str, tuple[str, Callable[[], list[pattern.RewriteRule]]]] = {
    "Softmax": ("attention", lambda: list(probed_attention_rules.rules)),
    "ReduceMean": ("LayerNorm", lambda: list(internals.LAYER_NORMALIZATION_RULES)),
    "Erf": ("GELU", _gelu_rules),
    "Tanh": ("GELU", _gelu_rules),
}


def unfused_notes(model: ir.Model) -> list[str]:
    """One line per leftover block: '<kind> at <module> stayed unfused: <reason>'."""
    notes = []
    for node in list(model.graph):
        if node.domain not in ("", "ai.onnx") or node.op_type not in KINDS:
            continue
        if node.op_type in ("Erf", "Tanh") and not _feeds_add(node):
            continue  # a plain activation (BERT's pooler), not a GELU's 1 + tanh(…)
        if node.op_type == "ReduceMean" and not _is_layer_norm_mean(node):
            continue  # a global average pool, a variance, a loss: not a LayerNorm's mean
        kind, rules = KINDS[node.op_type]
        reason = _best_reason(model, node, rules())
        notes.append(f"{kind} at {block_name(node)} stayed unfused: {reason}")
    return notes


def _feeds_add(node: ir.Node) -> bool:
    return any(user.op_type == "Add" for user, _ in node.outputs[0].uses())


def _users(node: ir.Node, *ops: str) -> list[ir.Node]:
    return [user for v in node.outputs for user, _ in v.uses() if user.op_type in ops]


def _is_layer_norm_mean(mean: ir.Node) -> bool:
    """Whether a ReduceMean starts a LayerNorm written out: x − mean(x), squared (Pow or
    Mul), averaged again, plus eps, square-rooted, and divided by (or its reciprocal
    multiplied). The walk starts at the first mean, so one block gets one line."""
    for centred in _users(mean, "Sub"):
        for square in _users(centred, "Pow", "Mul"):
            for variance in _users(square, "ReduceMean"):
                for eps in _users(variance, "Add"):
                    for root in _users(eps, "Sqrt"):
                        if _users(root, "Div", "Reciprocal"):
                            return True
    return False


def block_name(node: ir.Node) -> str:
    """The module the node came from: torch's module path when the exporter kept it, else
    the node's name without its last part (TorchScript names nodes /encoder/layer.0/...)."""
    scopes = node.metadata_props.get("pkg.torch.onnx.name_scopes")
    if scopes:
        try:
            path = [s for s in ast.literal_eval(scopes) if s]
        except (ValueError, SyntaxError):
            path = []
        if len(path) > 1:
            return path[-2]
    name = node.name or node.op_type
    return name.rsplit("/", 1)[0] if "/" in name.strip("/") else name


def _best_reason(model: ir.Model, start: ir.Node, rules: list[pattern.RewriteRule]) -> str:
    tracer = MatchingTracer()
    for node in _below(start):
        for rule in rules:
            try:
                rule.match(model, model.graph, node, tracer=tracer)
            except Exception:  # noqa: BLE001 - a diagnostic must never fail the compile
                continue
    best = max(
        (m for matches in tracer.best_matches_map.values() for m in matches),
        key=lambda m: m.score(),
        default=None,
    )
    if best is None:
        return "no fusion rule matches its ops (check: pattern)"
    if best.status.name == "SUCCESS":
        return "a rule matches it now, after the pass that applies it (check: pipeline order)"
    status = "check" if best.status.name == "CONDITION_FAILED" else "pattern"
    return f"{best.match_result.reason} (check: {status})"


def _below(start: ir.Node) -> list[ir.Node]:
    """`start` and the nodes reached from it within HOPS uses, nearest first."""
    found, frontier = [start], [start]
    for _ in range(HOPS):
        frontier = [user for node in frontier for v in node.outputs for user, _ in v.uses()]
        frontier = [n for n in dict.fromkeys(frontier) if n not in found]
        found.extend(frontier)
    return found
