"""Rewrite attention biases built from a padding mask, however they were exported, to the one
canonical form the attention fusions know: (1 − Cast(Unsqueeze(mask, [1, 2]))) · c.

Exporters build the same bias many ways (transformers 5 gathers from a flattened mask,
combines boolean masks with And, and turns them into 0/−inf with Where). Matching every such
graph is hopeless, so Kiln *probes* it instead: the subgraph that computes the bias from the
mask input is extracted and run on random 0/1 masks of several shapes, and the rewrite happens
only if every probe gives exactly 0 where the mask is 1 and one constant c where it is 0.
A −inf c becomes float32's lowest value, and the NaN guard exporters put after Softmax for
fully masked rows (no longer reachable with a finite c) is dropped. A decoder's bias, which
also hides later positions (0 only where the mask is 1 and j ≤ i), becomes
Where(mask & j ≤ i, 0, c), built so shape inference names its dims [batch, 1, seq, seq].
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import onnx_ir.passes.common as common

from kiln.ir.inputs import is_mask_input
from kiln.passes.base import KilnPass

PROBES = [(2, 5), (3, 8), (1, 3)]  # (batch, sequence) pairs the bias is checked at
LOWEST = float(np.finfo(np.float32).min)


def _mask_inputs(model: ir.Model) -> list[ir.Value]:
    return [
        v
        for v in model.graph.inputs
        if v.shape is not None
        and v.shape.rank() == 2
        and v.dtype in (ir.DataType.INT64, ir.DataType.INT32, ir.DataType.BOOL, ir.DataType.FLOAT)
        and is_mask_input(v.name)
    ]


def _sources(
    value: ir.Value, masks: set[str], memo: dict[int, bool] | None = None
) -> tuple[set[str], set[str]] | None:
    """(graph inputs read, values whose shape only is read) behind `value`; None if the
    subgraph reads data it cannot be probed without (anything but masks, shapes, constants).
    A Shape of something computed from the masks alone is followed, not cut: cutting there
    would feed zeros where the probe needs the real values. `memo` remembers, per value, the
    answer for Shape reads (without it, Shapes of Shapes make the walk exponential)."""
    memo = {} if memo is None else memo
    inputs, shaped, seen, stack = set(), set(), set(), [value]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        node = current.producer()
        if node is None:
            if current.const_value is None and not current.is_initializer():
                inputs.add(current.name)
            elif current.const_value is not None and current.const_value.size > 1 << 16:
                return None
            continue
        if node.op_type == "Shape" and not _masks_only(node.inputs[0], masks, memo):
            shaped.add(node.inputs[0].name)
            continue
        if node.domain not in ("", "ai.onnx") or any(
            a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
            for a in node.attributes.values()
        ):
            return None
        stack.extend(v for v in node.inputs if v is not None)
    return inputs, shaped


def _masks_only(value: ir.Value, masks: set[str], memo: dict[int, bool]) -> bool:
    """Whether `value` is computed from the masks and constants alone."""
    if id(value) not in memo:
        found = _sources(value, masks, memo)
        memo[id(value)] = found is not None and found[0] <= masks
    return memo[id(value)]


def _probe_fill(
    proto: onnx.ModelProto, bias: str, mask: ir.Value, shaped: dict[str, ir.Value]
) -> tuple[float, bool] | None:
    """(c, causal) if the bias equals where(mask, 0, c) at every probe shape, or, causal,
    where(mask & j ≤ i, 0, c) (a decoder's padding and causal masks in one); else None."""
    from kiln.backends import get_backend
    from kiln.backends.ort import OrtOptions

    try:
        sub = onnx.utils.Extractor(proto).extract_model([mask.name, *shaped], [bias])
        exe = get_backend("ort").compile(ir.serde.deserialize_model(sub), OrtOptions("basic"))
    except Exception:  # noqa: BLE001 - an unextractable subgraph is simply not probed
        return None
    outputs = _run_probes(exe, mask, shaped)
    for causal in (False, True):
        fill = _fill(outputs, causal)
        if fill is not None:
            return fill, causal
    return None


def _run_probes(exe, mask: ir.Value, shaped: dict[str, ir.Value]) -> list | None:
    """[(keep, bias)] at every probe shape; None when a probe cannot run."""
    rng = np.random.default_rng(0)
    outputs = []
    batch_dim, seq_dim = (str(d) for d in mask.shape)
    for batch, seq in PROBES:
        dims = {batch_dim: batch, seq_dim: seq}
        keep = rng.integers(0, 2, size=(batch, seq))
        keep[:, 0] = 1  # no fully masked rows: those are the exporters' special case
        feeds = {mask.name: keep.astype(mask.dtype.numpy())}
        for name, value in shaped.items():
            shape = [d if isinstance(d, int) else dims.get(str(d)) for d in value.shape or []]
            if value.shape is None or None in shape or value.dtype is None:
                return None
            feeds[name] = np.zeros(shape, value.dtype.numpy())
        try:
            (got,) = exe.run(feeds)
        except Exception:  # noqa: BLE001
            return None
        if got.ndim != 4 or got.shape[-1] != seq:
            return None
        outputs.append((keep, got))
    return outputs


def _fill(outputs: list | None, causal: bool) -> float | None:
    """The one fill c of every probe's bias when it is where(keep, 0, c), else None."""
    fills: set[float] = set()
    for keep, got in outputs or []:
        kept = keep[:, None, None, :].astype(bool)
        if causal:
            seq = keep.shape[1]
            kept = kept & np.tril(np.ones((seq, seq), bool))
        bias, kept = np.broadcast_arrays(got, kept)
        if not np.all(bias[kept] == 0) or bias[~kept].size == 0:
            return None
        fills.update(np.unique(bias[~kept]).tolist())
    if len(fills) != 1:
        return None
    fill = fills.pop()
    return fill if fill <= -1e4 else None


def _canonical(model: ir.Model, mask: ir.Value, fill: float, causal: bool) -> ir.Value:
    def const(name: str, array: np.ndarray) -> ir.Value:
        value = ir.Value(name=name, const_value=ir.tensor(array, name=name))
        model.graph.register_initializer(value)
        return value

    if causal:
        return _canonical_causal(model, mask, fill, const)
    prefix = f"kiln.canonical_mask.{mask.name}"
    axes = const(f"{prefix}.axes", np.array([1, 2], np.int64))
    one = const(f"{prefix}.one", np.array(1.0, np.float32))
    fill_value = const(f"{prefix}.fill", np.array(max(fill, LOWEST), np.float32))
    nodes = [
        ir.node("Unsqueeze", [mask, axes], name=f"{prefix}.Unsqueeze"),
    ]
    cast = ir.node("Cast", nodes[-1].outputs, {"to": ir.DataType.FLOAT}, name=f"{prefix}.Cast")
    nodes.append(cast)
    nodes.append(ir.node("Sub", [one, nodes[-1].outputs[0]], name=f"{prefix}.Sub"))
    nodes.append(ir.node("Mul", [nodes[-1].outputs[0], fill_value], name=f"{prefix}.Mul"))
    for node in nodes:
        node.outputs[0].name = node.name
    # First in the graph: they read only a graph input, and shape inference walks in order.
    model.graph.insert_before(next(iter(model.graph)), nodes)
    return nodes[-1].outputs[0]


def _canonical_causal(model: ir.Model, mask: ir.Value, fill: float, const) -> ir.Value:
    """Where(mask & (j ≤ i), 0, c) over [batch, 1, seq, seq], built so that shape
    inference names every dim (the attention fusion probes it; no rule matches its form)."""
    prefix = f"kiln.canonical_causal.{mask.name}"
    nodes: list[ir.Node] = []

    def add(op: str, inputs: list, name: str, **attributes) -> ir.Value:
        nodes.append(ir.node(op, inputs, attributes, name=f"{prefix}.{name}"))
        nodes[-1].outputs[0].name = nodes[-1].name
        return nodes[-1].outputs[0]

    seq = add("Shape", [mask], "seq", start=1, end=2)
    seq = add("Squeeze", [seq, const(f"{prefix}.axis0", np.array([0]))], "seq_scalar")
    start = const(f"{prefix}.zero", np.array(0, np.int64))
    step = const(f"{prefix}.step", np.array(1, np.int64))
    positions = add("Range", [start, seq, step], "positions")
    keys = add("Unsqueeze", [positions, const(f"{prefix}.axes_row", np.array([0]))], "keys")
    queries = add("Unsqueeze", [positions, const(f"{prefix}.axes_col", np.array([1]))], "queries")
    causal = add("LessOrEqual", [keys, queries], "causal")
    padding = add("Unsqueeze", [mask, const(f"{prefix}.axes", np.array([1, 2]))], "padding")
    padding = add("Cast", [padding], "padding_bool", to=ir.DataType.BOOL)
    keep = add("And", [causal, padding], "keep")
    zero = const(f"{prefix}.zero_bias", np.array(0.0, np.float32))
    fill_value = const(f"{prefix}.fill", np.array(max(fill, LOWEST), np.float32))
    bias = add("Where", [keep, zero, fill_value], "bias")
    model.graph.insert_before(next(iter(model.graph)), nodes)
    return bias


def _drop_nan_guard(softmax: ir.Node) -> None:
    """Where(IsNaN(p), 0, p) after Softmax → p."""
    probs = softmax.outputs[0]
    for user, _ in list(probs.uses()):
        if user.op_type != "IsNaN":
            continue
        for where, index in list(user.outputs[0].uses()):
            if where.op_type == "Where" and index == 0 and where.inputs[2] is probs:
                ir.convenience.replace_all_uses_with(where.outputs[0], probs)


class CanonicalMaskPass(KilnPass):
    """Guarantee: outputs unchanged for 0/1 masks with at least one kept position per row
    (checked numerically on the bias itself before rewriting).

    Skips If/Loop/Scan bodies: it rewrites only main-graph attention, and a bias computed
    through control flow is not probed (its subgraph is refused as a source)."""

    name = "canonical-mask"
    stage = "simplify"
    summary = "Probe exported attention-mask subgraphs; rewrite to (1 − mask)·c, causal ones too."

    def apply(self, model: ir.Model) -> int:
        common.ShapeInferencePass()(model)  # both passes decide from shapes
        masks = {v.name: v for v in _mask_inputs(model)}
        memo: dict[int, bool] = {}  # shared by every walk below: one model, one answer
        sites: dict[str, list[tuple[ir.Node, ir.Node, int, set[str]]]] = {}
        for softmax in [n for n in model.graph if n.op_type == "Softmax"]:
            add = softmax.inputs[0].producer()
            if add is None or add.op_type != "Add":
                continue
            for index, operand in enumerate(add.inputs):
                found = _sources(operand, set(masks), memo) if operand is not None else None
                if found and len(found[0]) == 1 and next(iter(found[0])) in masks:
                    sites.setdefault(operand.name, []).append((softmax, add, index, found[1]))
        if not sites:
            return 0
        proto = ir.serde.serialize_model(model)
        values = {v.name: v for n in model.graph for v in n.outputs} | {
            v.name: v for v in model.graph.inputs
        }
        count, canonical = 0, {}
        for bias, uses in sites.items():
            mask_name = next(iter(_sources(values[bias], set(masks), memo)[0]))
            shaped = {name: values[name] for name in uses[0][3]}
            probed = _probe_fill(proto, bias, masks[mask_name], shaped)
            if probed is None:
                continue
            if (mask_name, probed) not in canonical:
                canonical[mask_name, probed] = _canonical(model, masks[mask_name], *probed)
            for softmax, add, index, _ in uses:
                add.replace_input_with(index, canonical[mask_name, probed])
                _drop_nan_guard(softmax)
                count += 1
        return count
