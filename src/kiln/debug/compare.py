"""Layer-wise comparison of two sides and the first layer where they part.

Both sides run on the same inputs with the tensors they share exposed as extra graph outputs of
a copy of each side's graph — the graph as compiled, so every Kiln fusion stays fused. Only
tensors computed on both sides *and* in the original graph are compared: Kiln's rewrites keep
the names of the tensors they replace, so a fused kernel's output is compared with the tensor
of the same name in the other graph, and its insides, which one side no longer has, are not
invented. Quantizers keep names too (a dynamic-int8 MatMul's last Mul computes the MatMul's
output; a QDQ Conv still computes its float output), so the comparison is of float tensors.

Each row is one original node's output, in the original's topological order, with the error of
the second side against the first (max abs, max rel, worst per-sample cosine, as
`kiln.verify` measures them) and, for each side, the node that computed it, the passes that
made that node and the precision it runs in; for a model PyTorch exported, also the module
and the source line (`file:line`) the original node came from. The budget is Kiln's: fp32
against fp32 is held to the fp32 tolerance (max abs ≤ 1e-4 · the tensor's scale); anything
lower to cosine ≥ 0.99.

The **first divergence** is the earliest row that breaks the budget while every compared tensor
it is computed from still keeps it: the layer that broke, not one that inherited the damage.
When side B runs that row in side A's own precision, it computes what A computes and only
carries error handed to it; the first divergence is then the lower-precision layer upstream
whose error jumps most, and `shows_at` names the row where the budget broke.

Engines fuse kernels of their own too (ONNX Runtime's QDQ kernels, OpenVINO's Conv+ReLU and its
int8 pipeline); a tensor exposed as an output must be materialised, which can keep such a fusion
from forming. So each side's exposed run is checked against its plain run: when its own outputs
moved beyond the fp32 tolerance the engine compiled another program (OpenVINO does for NNCF's int8
graphs), the notes say its per-layer figures are approximate, and the first divergence is
re-measured with only it and the tensors it is computed from exposed, and said confirmed or not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir

from kiln.debug.sides import Side, load_side, synthesized_feeds
from kiln.errors import KilnError
from kiln.ir.provenance import trace_of
from kiln.verify import FP32_TOLERANCE, MIN_COSINE, _is_float, check_output, cosine

Say = Callable[[str], None]
Feeds = dict[str, np.ndarray]
METRICS = ("auto", "max-abs", "cosine")
DEFAULT_MAX_DROP = round(1.0 - MIN_COSINE, 6)  # cosine ≥ 0.99, as verification
# Nodes whose outputs say nothing about numerical drift: weights and shape bookkeeping.
_SKIPPED_OPS = {"Constant", "ConstantOfShape", "Shape", "Size"}


@dataclass(frozen=True)
class LayerBudget:
    """How far a tensor of side B may be from side A's: within the fp32 tolerance
    (`max-abs`), or cosine ≥ 1 − max_drop (`cosine`)."""

    metric: str = "cosine"
    max_drop: float = DEFAULT_MAX_DROP

    @property
    def min_cosine(self) -> float:
        return 1.0 - self.max_drop

    def keeps(self, check: Any, cos: float | None) -> bool:
        if check.problem:  # NaN/inf on one side, another shape: broken whatever the metric
            return False
        if self.metric == "max-abs" or cos is None:  # integers: exact, as check_output says
            return bool(check.ok)
        return bool(cos >= self.min_cosine)

    def describe(self) -> str:
        if self.metric == "max-abs":
            return f"max abs ≤ {FP32_TOLERANCE:g} · scale (Kiln's fp32 tolerance)"
        return f"cosine ≥ {self.min_cosine:.10g}"  # 0.99999, not a rounded 1


def _check_budget(metric: str, max_drop: float | None) -> None:
    if metric not in METRICS:
        raise KilnError(f"unknown --metric '{metric}'; use one of {', '.join(METRICS)}.")
    if max_drop is not None and not 0 <= max_drop < 1:
        raise KilnError(f"--max-drop {max_drop} is a fraction: use a value in [0, 1), e.g. 0.01.")


def layer_budget(
    a: Side, b: Side, metric: str = "auto", max_drop: float | None = None
) -> LayerBudget:
    """`auto`: fp32 against fp32 is held to the fp32 tolerance, anything lower to cosine."""
    _check_budget(metric, max_drop)
    if metric == "auto":
        metric = "max-abs" if a.precision == b.precision == "fp32" else "cosine"
    return LayerBudget(metric, DEFAULT_MAX_DROP if max_drop is None else max_drop)


@dataclass
class Comparison:
    """What `compare` found: the rows, the first divergence, and what ran."""

    a: Side
    b: Side
    original: ir.Model
    budget: LayerBudget
    inputs: str
    feeds: Feeds
    rows: list[dict[str, Any]]
    first: dict[str, Any] | None
    notes: list[str] = field(default_factory=list)
    related: bool = True  # False: tensors named alike are not the same (unrelated models)
    outputs_a: Feeds = field(default_factory=dict)  # side A's own outputs, nothing exposed

    @property
    def shared(self) -> int:
        """Intermediate tensors compared: computed by both sides (and the original)."""
        return sum(not row["output"] for row in self.rows)

    @property
    def graph_name(self) -> str:
        return self.original.graph.name or "main_graph"

    def to_json(self) -> dict[str, Any]:
        return {
            "a": self.a.describe(),
            "b": self.b.describe(),
            "graph": self.graph_name,
            "budget": {
                "metric": self.budget.metric,
                "max_drop": self.budget.max_drop,
                "text": self.budget.describe(),
            },
            "inputs": self.inputs,
            "shared_tensors": self.shared,
            "related": self.related,
            "first_divergence": self.first["node"] if self.first else None,
            "first_divergence_row": self.first,
            "diverging": sum(not r["ok"] for r in self.rows),
            "exact": sum(r["exact"] for r in self.rows),
            "layers": self.rows,
            "notes": self.notes,
        }


def compare(
    a: str,
    b: str,
    *,
    inputs: str | None = None,
    shapes: dict[str, tuple[int, ...]] | None = None,
    metric: str = "auto",
    max_drop: float | None = None,
    say: Say = lambda _msg: None,
) -> Comparison:
    """Compare side `b` against side `a` layer by layer (see the module docstring); each side
    is an .onnx file, zoo:NAME, a NAME.kiln artifact or MODEL@ENGINE:PRECISION."""
    _check_budget(metric, max_drop)  # before anything is compiled
    say(f"loading {a}")
    side_a = load_side(a, inputs=inputs, shapes=shapes, say=say)
    say(f"loading {b}")
    side_b = load_side(b, inputs=inputs, shapes=shapes, say=say)
    return compare_sides(
        side_a, side_b, inputs=inputs, shapes=shapes, metric=metric, max_drop=max_drop, say=say
    )


def compare_sides(
    side_a: Side,
    side_b: Side,
    *,
    inputs: str | None = None,
    shapes: dict[str, tuple[int, ...]] | None = None,
    feeds: Feeds | None = None,
    metric: str = "auto",
    max_drop: float | None = None,
    say: Say = lambda _msg: None,
) -> Comparison:
    """`compare` of two sides already loaded (`kiln debug` keeps them); `feeds`, when given,
    are the inputs instead of `inputs` or synthesized ones."""
    budget = layer_budget(side_a, side_b, metric, max_drop)
    original = _original(side_a, side_b)
    shapes = shapes or side_a.shapes or side_b.shapes  # an artifact's own, if none given
    feeds, source = _feeds(original, (side_a, side_b), inputs, shapes, feeds)
    pairs, shared = _pairs(original, side_a, side_b)
    notes = [*side_a.notes, *side_b.notes]
    if not shared:
        notes.append(
            f"{side_a.spec} and {side_b.spec} share no intermediate tensors (no tensor name in "
            "common with the original): only the outputs are compared"
        )
    say(f"running {side_a.label}")
    ran_a = _run(side_a, [p[0] for p in pairs], feeds, source)
    say(f"running {side_b.label}")
    ran_b = _run(side_b, [p[1] for p in pairs], feeds, source)
    outputs_a = {v.name for v in side_a.model.graph.outputs}
    unlike = _not_the_same(pairs, outputs_a, ran_a, ran_b, side_a, side_b)
    if unlike:  # unrelated models sharing node names: no layer of one is a layer of the other
        notes.append(
            f"{side_a.spec} and {side_b.spec} are not two versions of one model: "
            f"{len(unlike)} tensors share a name but not the tensor ({unlike[0]}); only the "
            "outputs are compared"
        )
        pairs = [p for p in pairs if p[0] in outputs_a]
    rows = _rows(pairs, ran_a, ran_b, side_a, side_b, original, budget)
    lost = [p[0] for p in pairs if p[0] not in ran_a or p[1] not in ran_b]
    if lost:
        notes.append(f"{len(lost)} shared tensors could not be read back from an engine")
    first = None if unlike else first_divergence(rows, original)
    plain_a, plain_b = run_exposed(side_a, [], feeds), run_exposed(side_b, [], feeds)
    sides = ((side_a, ran_a, plain_a), (side_b, ran_b, plain_b))
    perturbed = [side for side, ran, plain in sides if _perturbed(ran, plain)]
    for side in perturbed:
        notes.append(
            f"exposing the intermediate tensors changed {side.spec}'s own outputs: {side.engine} "
            "compiled the exposed graph differently (e.g. other int8 kernels), so its "
            "per-layer figures are approximate"
        )
    if perturbed and first is not None:
        say(f"confirming {first['node']} with only it and its inputs exposed")
        notes.append(_confirmation(first, pairs, rows, side_a, side_b, original, budget, feeds))
    return Comparison(
        side_a, side_b, original, budget, source, feeds, rows, first, notes,
        related=not unlike, outputs_a=plain_a,
    )  # fmt: skip


def _not_the_same(
    pairs: list[tuple[str, str, str]],
    outputs: set[str],
    ran_a: dict[str, Any],
    ran_b: dict[str, Any],
    a: Side,
    b: Side,
) -> list[str]:
    """The intermediate tensors named alike on both sides that are not one tensor, each with
    why: other shapes, a node of the same name computing another op (neither made by a
    pass), or compiled nodes made from no original node in common."""
    found = []
    for name_a, name_b, node in pairs:
        if name_a in outputs or name_a not in ran_a or name_b not in ran_b:
            continue  # outputs are compared whatever they are
        shape_a, shape_b = np.shape(ran_a[name_a]), np.shape(ran_b[name_b])
        if shape_a != shape_b:
            found.append(f"{node}: shape {list(shape_a)} vs {list(shape_b)}")
            continue
        made_a, made_b = a.producer(name_a), b.producer(name_b)
        if made_a is None or made_b is None:
            continue
        origin_a, origin_b = a.origin(made_a), b.origin(made_b)
        op_a, op_b = _op(made_a), _op(made_b)
        untouched = not origin_a["passes"] and not origin_b["passes"]
        if untouched and made_a.name == made_b.name and op_a != op_b:
            found.append(f"{node}: {op_a} vs {op_b}")
        elif _recorded(a, made_a) and _recorded(b, made_b) and not _share(origin_a, origin_b):
            found.append(f"{node}: made from {origin_a['origin']} vs {origin_b['origin']}")
    return found


def _share(origin_a: dict[str, Any], origin_b: dict[str, Any]) -> bool:
    return bool(set(origin_a["origin"]) & set(origin_b["origin"]))


def _op(node: ir.Node) -> str:
    return f"{node.domain}::{node.op_type}" if node.domain else node.op_type


def _recorded(side: Side, node: ir.Node) -> bool:
    """Whether a compiled side's provenance names the original nodes behind `node` (nodes an
    engine's quantizer made have none)."""
    return side.provenance is not None and bool(
        side.provenance.get(node.name or "", {}).get("origin")
    )


def _original(a: Side, b: Side) -> ir.Model:
    """The graph the rows are named and ordered by: A's original, else B's."""
    for side in (a, b):
        if side.original is not None:
            return side.original
    raise KilnError(
        f"cannot name the layers: {a.missing or b.missing}. Restore it, or compare an "
        f"artifact with its original model directly: kiln compare ORIGINAL.onnx {b.spec}"
    )


def _feeds(
    original: ir.Model,
    sides: tuple[Side, Side],
    inputs: str | None,
    shapes: dict[str, tuple[int, ...]] | None,
    given: Feeds | None = None,
) -> tuple[Feeds, str]:
    """The user's inputs, or synthesized ones; checked against both sides before any run."""
    from kiln.ir.inputs import check_feeds, input_names, read_inputs

    a, b = (set(input_names(side.model)) for side in sides)
    if a != b:
        raise KilnError(
            f"{sides[0].spec} takes inputs {sorted(a)} and {sides[1].spec} {sorted(b)}: "
            "compare two versions of one model, which take the same inputs."
        )
    if given is not None:
        feeds, source = given, "given"
    elif inputs is not None:
        feeds, source = read_inputs(inputs, original), inputs
    else:
        feeds, source = synthesized_feeds(original, sides, shapes)
    for side in sides:
        check_feeds(side.model, feeds, where=f"{source} (for {side.spec})")
    return feeds, source


def _pairs(original: ir.Model, a: Side, b: Side) -> tuple[list[tuple[str, str, str]], int]:
    """(tensor in A, tensor in B, original node) to compare, in the original's order, and how
    many of them are intermediates. Outputs are always compared: by name, else by position."""
    from_a, from_b = _computed(a.model), _computed(b.model)
    outputs_a = [v.name for v in a.model.graph.outputs]
    outputs_b = [v.name for v in b.model.graph.outputs]
    pairs = []
    for node in original.graph:
        if node.op_type in _SKIPPED_OPS and node.domain in ("", "ai.onnx"):
            continue
        for value in node.outputs:
            name = value.name
            if name and name in from_a and name in from_b:
                pairs.append((name, name, node.name or name))
    shared = sum(1 for p in pairs if p[0] not in outputs_a)
    named = {p[0] for p in pairs}
    if len(outputs_a) == len(outputs_b):
        producers = {v.name: n.name for n in original.graph for v in n.outputs}
        for name_a, name_b in zip(outputs_a, outputs_b, strict=True):
            if name_a not in named:  # another name on B's side (a re-export): by position
                pairs.append((name_a, name_b, producers.get(name_a) or name_a))
    elif not pairs:
        raise KilnError(
            f"{a.spec} has {len(outputs_a)} outputs and {b.spec} {len(outputs_b)}, and they "
            "share no tensor: there is nothing to compare."
        )
    return pairs, shared


def _computed(model: ir.Model) -> set[str]:
    return {v.name for node in model.graph for v in node.outputs if v.name}


def expose(model: ir.Model, names: list[str]) -> ir.Model:
    """A copy of `model` that also outputs the tensors `names` it computes (the fusions stay:
    they are in the graph already). Types come from shape inference where it knew them; the
    engines type the rest themselves."""
    from kiln.compiler.reference import copy_model

    copy = copy_model(model)
    values = {v.name: v for node in copy.graph for v in node.outputs if v.name}
    present = {v.name for v in copy.graph.outputs}
    for name in dict.fromkeys(names):
        if name in values and name not in present:
            copy.graph.outputs.append(values[name])
            present.add(name)
    return copy


def _run(side: Side, names: list[str], feeds: Feeds, source: str) -> dict[str, Any]:
    """`run_exposed`; a failure on synthesized inputs says how to give better ones."""
    try:
        return run_exposed(side, names, feeds)
    except KilnError as exc:
        if not source.startswith("synthesized"):
            raise
        raise KilnError(
            f"{side.spec} does not run on the synthesized inputs ({exc}); give their shapes "
            "with --shape INPUT=D0xD1x... or the inputs themselves with --inputs f.npz."
        ) from None


def _perturbed(ran: dict[str, Any], plain: dict[str, Any]) -> bool:
    """Whether the exposed graph's own outputs differ from the plain graph's beyond the fp32
    tolerance: the engine then compiled another program, not merely one with more outputs."""
    return any(
        not check_output(name, plain[name], ran[name], FP32_TOLERANCE).ok
        for name in plain
        if name in ran
    )


def _confirmation(
    first: dict[str, Any],
    pairs: list[tuple[str, str, str]],
    rows: list[dict[str, Any]],
    a: Side,
    b: Side,
    original: ir.Model,
    budget: LayerBudget,
    feeds: Feeds,
) -> str:
    """Re-run both sides with only the row where the budget broke (the first divergence, or
    the layer it carries its error to) and the tensors it is computed from exposed, and say
    whether it still breaks the budget while they keep it."""
    broke = first.get("shows_at", first)["tensor"]
    inputs = compared_inputs(original, {r["tensor"] for r in rows}).get(broke, set())
    few = [p for p in pairs if p[0] == broke or p[0] in inputs]
    again = _rows(
        few,
        run_exposed(a, [p[0] for p in few], feeds),
        run_exposed(b, [p[1] for p in few], feeds),
        a, b, original, budget,
    )  # fmt: skip
    row = next((r for r in again if r["tensor"] == broke), None)
    held = row is not None and not row["ok"] and all(r["ok"] for r in again if r is not row)
    verdict = "confirmed" if held else "not confirmed"
    return (
        f"first divergence {first['node']} {verdict} with only it and its {len(inputs)} "
        "compared inputs exposed"
    )


def run_exposed(side: Side, names: list[str], feeds: Feeds) -> dict[str, Any]:
    """Run `side` once on `feeds`, returning every tensor of `names` the engine gave back."""
    from kiln.backends import get_backend

    executable = get_backend(side.engine).compile(expose(side.model, names), side.options)
    outputs = executable.run(feeds)
    return dict(zip(executable.output_names, outputs, strict=True))


def _rows(
    pairs: list[tuple[str, str, str]],
    ran_a: dict[str, Any],
    ran_b: dict[str, Any],
    a: Side,
    b: Side,
    original: ir.Model,
    budget: LayerBudget,
) -> list[dict[str, Any]]:
    outputs = {v.name for v in original.graph.outputs}
    kinds = {n.name: n.op_type for n in original.graph}
    traces = {n.name: trace_of(n) for n in original.graph}  # a PyTorch source's module, line
    rows = []
    for name_a, name_b, node in pairs:
        if name_a not in ran_a or name_b not in ran_b:
            continue
        ref, new = ran_a[name_a], ran_b[name_b]
        floating = _floating(ref) and _floating(new)
        if not floating and name_a not in outputs:
            continue  # an index or a mask computed alike on both sides is not a layer
        check = check_output(name_a, ref, new, FP32_TOLERANCE)
        cos = cosine(ref, new) if floating and _same_shape(ref, new) else None
        rows.append({
            "index": len(rows),
            "node": node,
            "op_type": kinds.get(node, "?"),
            "tensor": name_a,
            "shape": list(np.shape(ref)) if isinstance(ref, np.ndarray) else None,
            "output": name_a in outputs,
            "scale": check.scale,  # the largest finite |A| (fp32 bound: 1e-4 · scale)
            "max_abs": check.max_abs,
            "max_rel": check.max_rel,
            "cosine": cos,
            "exact": check.problem is None and check.max_abs == 0.0 and _equal(ref, new),
            "ok": budget.keeps(check, cos),
            "problem": check.problem,
            "a": _made_by(a, name_a),
            "b": _made_by(b, name_b),
            "module": traces.get(node, {}).get("module", []),
            "source": traces.get(node, {}).get("source", []),
        })  # fmt: skip
    return rows


def _floating(array: Any) -> bool:
    return isinstance(array, np.ndarray) and _is_float(array.dtype)


def _same_shape(ref: np.ndarray, new: np.ndarray) -> bool:
    return ref.shape == new.shape


def _equal(ref: Any, new: Any) -> bool:
    """Bit for bit (NaN equal to NaN): what "exact" means in a self-comparison."""
    if not (isinstance(ref, np.ndarray) and isinstance(new, np.ndarray)):
        return False
    if ref.shape != new.shape or ref.dtype != new.dtype:
        return False
    return bool(np.array_equal(ref, new, equal_nan=_is_float(ref.dtype)))


def _made_by(side: Side, tensor: str) -> dict[str, Any]:
    """The node of `side` that computed `tensor`, the passes that made it, its precision."""
    node = side.producer(tensor)
    if node is None:
        return {"node": None, "op_type": None, "passes": [], "precision": side.precision}
    op = f"{node.domain}::{node.op_type}" if node.domain else node.op_type
    return {
        "node": node.name,
        "op_type": op,
        "origin": side.origin(node)["origin"],
        "passes": _passes(side, node),
        "precision": side.precision_of(node),
    }


def _passes(side: Side, node: ir.Node) -> list[str]:
    """The passes that made `node` and the nodes made for it alone that feed it: a QDQ
    quantizer keeps a Conv as it was and feeds it dequantized inputs made for it, and the
    Conv then runs in int8 by that quantizer's doing."""
    origin = set(side.origin(node)["origin"])
    passes = list(side.origin(node)["passes"])
    for value in node.inputs:
        feeder = value.producer() if value is not None else None
        if feeder is not None and set(side.origin(feeder)["origin"]) == origin:
            passes += side.origin(feeder)["passes"]
    return list(dict.fromkeys(passes))


def first_divergence(rows: list[dict[str, Any]], original: ir.Model) -> dict[str, Any] | None:
    """The layer that broke: the earliest row out of budget whose compared inputs are all
    within it — or, when that row only carries error handed to it, the lower-precision layer
    upstream that added it (`shows_at` then names the row where the budget broke)."""
    kept = {row["tensor"]: row["ok"] for row in rows}
    inputs = compared_inputs(original, set(kept))
    broke = next(
        (r for r in rows if not r["ok"] and all(kept[t] for t in inputs.get(r["tensor"], ()))),
        None,
    )
    if broke is None:
        return None
    source = _lossy_source(broke, rows, inputs)
    if source is None:
        return broke
    shown = {k: broke[k] for k in ("index", "node", "op_type", "tensor", "cosine", "max_abs")}
    return {**source, "shows_at": shown}


def _lossy_source(
    broke: dict[str, Any], rows: list[dict[str, Any]], inputs: dict[str, set[str]]
) -> dict[str, Any] | None:
    """The lower-precision layer upstream of `broke` that added the most error, when `broke`
    itself runs in side A's precision on side B; else None.

    A layer B runs in A's own precision computes what A computes: error past the budget
    there was handed to it, and may merely have grown (a Sub cancelling a large common part
    leaves the error and little of the signal). The layer that made it is a lossy one (int8,
    bf16) upstream, within budget itself; the one whose error jumps most over its inputs'
    is named, since each layer after it inherits its error."""
    if not _lossy(broke):
        by_tensor = {row["tensor"]: row for row in rows}
        upstream = _ancestors(broke["tensor"], inputs)
        jumps = {
            t: _drop(by_tensor[t]) - max((_drop(by_tensor[i]) for i in inputs[t]), default=0.0)
            for t in upstream
            if _lossy(by_tensor[t])
        }
        best = max(jumps, key=lambda t: (jumps[t], -by_tensor[t]["index"]), default=None)
        if best is not None and jumps[best] > 0:
            return by_tensor[best]
    return None


def _lossy(row: dict[str, Any]) -> bool:
    """Whether side B computes this row in another precision than side A (int8 against fp32)."""
    return (row["b"] or {}).get("precision") != (row["a"] or {}).get("precision")


def _drop(row: dict[str, Any]) -> float:
    """How far a row is from agreeing: 1 − cosine (0 where no cosine was measured)."""
    cos = row["cosine"]
    return 0.0 if cos is None or cos != cos else 1.0 - cos  # cos != cos: NaN


def _ancestors(tensor: str, inputs: dict[str, set[str]]) -> set[str]:
    """Every compared tensor `tensor` is computed from, however far up."""
    found: set[str] = set()
    todo = list(inputs.get(tensor, ()))
    while todo:
        name = todo.pop()
        if name not in found:
            found.add(name)
            todo += inputs.get(name, ())
    return found


def compared_inputs(original: ir.Model, compared: set[str]) -> dict[str, set[str]]:
    """For each compared tensor, the nearest compared tensors it is computed from (through
    any number of tensors that are not compared, e.g. the insides of a fused kernel)."""
    nearest: dict[str, set[str]] = {}  # any tensor → the nearest compared ones at or above it
    found: dict[str, set[str]] = {}
    for node in original.graph:  # topological order: producers first
        above: set[str] = set()
        for value in node.inputs:
            if value is not None and value.name:
                above |= nearest.get(value.name, set())
        for value in node.outputs:
            if not value.name:
                continue
            if value.name in compared:
                found[value.name] = above
                nearest[value.name] = {value.name}
            else:
                nearest[value.name] = above
    return found
