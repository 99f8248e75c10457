"""Bottleneck diagnosis: one small rule per class, each with its evidence and a Kiln action.

Every rule measures the share of the per-run kernel time its class accounts for; findings are
ranked by that share. Each kernel counts toward one finding only, the most specific cause
first (RULES' order): a Softmax inside an unfused attention block is the attention's, not
"memory-bound", so the shares add up to at most 100 %. Rules read the profiled kernels
(already placed on the roofline) and the graph the engine was given; none runs anything.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import onnx_ir as ir

from kiln.cost import peak_compute
from kiln.profile.finding import Finding
from kiln.profile.mapping import core_op
from kiln.profile.roofline import mixed_peak

NEAR_ROOF = 0.4  # efficiency at which a kernel counts as running at the roof
FASTER = 1.25  # a precision's compute peak this much above another's is worth a change
OVERHEAD = 0.1  # below this efficiency the time is not the work's (dispatch, threads)
THREADS_USED = 0.6  # CPU time / (wall × cores) under this: cores sit idle
MAC_OPS = {"MatMul", "Gemm", "Conv", "ConvTranspose", "Attention", "MultiHeadAttention"}
DATA_MOVEMENT = {
    "Transpose", "Reshape", "Concat", "Gather", "GatherElements", "Slice", "Split", "Squeeze",
    "Unsqueeze", "Expand", "Tile", "Pad", "Flatten", "Identity", "Cast", "ReorderInput",
    "ReorderOutput", "DepthToSpace", "SpaceToDepth",
}  # fmt: skip
# Operators that LayerNorm, GELU and Softmax decompose into when exported op by op.
PRIMITIVES = {"Erf", "Pow", "Sqrt", "ReduceMean", "Reciprocal", "ReduceSum", "Exp", "ReduceMax"}
# ... of which these appear in hardly anything else: a model without them has no such chains
TELLTALE = {"Erf", "Pow", "Sqrt", "Reciprocal"}
SHAPE_SOURCES = {"Shape", "Size"}
SHAPE_MATH = {
    "Gather", "Concat", "Unsqueeze", "Squeeze", "Slice", "Cast", "Add", "Sub", "Mul", "Div",
    "Range", "Equal", "Where", "ConstantOfShape", "Reshape", "ReduceProd", "Min", "Max",
}  # fmt: skip
_SCORE_PATH = {"Add", "Div", "Mul", "Where", "Sub", "Cast"}  # between Q·Kᵀ and Softmax
_PROB_PATH = {"Cast", "Dropout", "Identity"}  # between Softmax and ·V


@dataclass
class Context:
    nodes: list[dict[str, Any]]  # per-kernel entries, slowest first
    model: ir.Model  # the graph the engine was given
    source: str  # the original model (an artifact's source), for the commands we suggest
    peaks: Any
    cpu_utilization: float | None
    cores: int
    idle_fraction: float | None  # of all cores' time, used by no process at all
    # precision → what timing it for this model found (`tried_precisions`): a precision
    # measured and not kept is never proposed, whatever the peaks say
    tried: dict[str, str] = field(default_factory=dict)
    claimed: set[str] = field(default_factory=set)  # kernels an earlier rule explained

    def free(self, chosen: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The kernels no earlier rule has explained."""
        return [n for n in chosen if n["node"] not in self.claimed]

    @property
    def total_ms(self) -> float:
        return sum(n["median_ms"] for n in self.nodes)


def _finding(
    ctx: Context, kind: str, title: str, chosen: list[dict], evidence: str, action: str
) -> Finding | None:
    if not chosen:
        return None
    ctx.claimed.update(n["node"] for n in chosen)
    time_ms = sum(n["median_ms"] for n in chosen)
    share = time_ms / ctx.total_ms if ctx.total_ms > 0 else 0.0
    top = [n["node"] for n in sorted(chosen, key=lambda n: n["median_ms"], reverse=True)[:5]]
    return Finding(kind, title, share, time_ms, evidence, action, nodes=top)


def _optimize(ctx: Context, flags: str = "") -> str:
    return f"kiln optimize {ctx.source}{' ' + flags if flags else ''}"


def compute_bound(ctx: Context) -> Finding | None:
    near = ctx.free(
        [n for n in ctx.nodes if n.get("bound") == "compute" and n["efficiency"] >= NEAR_ROOF]
    )
    flops = sum(n["flops"] for n in near)
    time_s = sum(n["median_ms"] for n in near) / 1e3
    peak, precision = mixed_peak(near, ctx.peaks)
    # only a precision whose compute roof is higher than the one these kernels run under helps
    macs = _macs(near)
    lower = _lower_precisions(
        ctx, macs, gain=lambda p: _peak(ctx, p) >= FASTER * mixed_peak(macs, ctx.peaks)[0]
    )
    action = (
        f"{_try_narrower(ctx, lower)} ({_roofs_text(ctx, lower, macs)})"
        if lower
        else "more cores or a faster machine: these kernels already run at the roof"
    )
    evidence = (
        f"{len(near)} kernels at ≥ {NEAR_ROOF:.0%} of their roof, "
        f"{flops / time_s / 1e9 if time_s else 0:.0f} GFLOP/s achieved against "
        f"{peak:.0f} GFLOP/s {precision} peak{_tried_text(ctx, macs)}"
    )
    return _finding(ctx, "compute-bound", "compute-bound near the roof", near, evidence, action)


# precision → bits per value: a kernel is never advised a precision at least as wide as the
# one it already runs in
_BITS = {"fp32": 32, "fp16": 16, "bf16": 16, "int8": 8}


def _peak(ctx: Context, precision: str) -> float:
    return peak_compute(ctx.peaks, precision)[0]


def _macs(kernels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The kernels a narrower precision changes: quantization and bf16 builds give MatMul and
    Conv narrower kernels; the rest of the graph keeps its own."""
    return [n for n in kernels if core_op(n["op_type"]) in MAC_OPS]


def _narrower(ctx: Context, kernels: list[dict[str, Any]]) -> list[str]:
    """Precisions narrower than every one of `kernels` runs in that this machine has kernels
    for (a peak `kiln doctor` measured): what an artifact already beats is never proposed."""
    if not kernels:
        return []
    narrowest = min(_BITS.get(n["precision"], 32) for n in kernels)
    measured = {"int8": ctx.peaks.int8_gops, "bf16": ctx.peaks.bf16_gflops}
    return [p for p in ("int8", "bf16") if measured[p] and _BITS[p] < narrowest]


def _lower_precisions(
    ctx: Context, kernels: list[dict[str, Any]], gain: Callable[[str], bool]
) -> list[str]:
    """`_narrower` precisions for which `gain` holds and that were not already timed for this
    model and found no faster (`Context.tried`): a measurement outranks a peak."""
    return [p for p in _narrower(ctx, kernels) if gain(p) and p not in ctx.tried]


def _try_narrower(ctx: Context, precisions: list[str]) -> str:
    """Advice to build and time the precisions, not a promise: a peak says what this CPU's
    GEMMs reach, not what this model's kernels will; `--precision auto` keeps a precision
    only where it verifies within the accuracy budget and is faster."""
    flags = "--backend auto --precision auto" if "bf16" in precisions else "--precision auto"
    return (
        f"try {' or '.join(precisions)} and measure: {_optimize(ctx, flags)} builds "
        f"{'each' if len(precisions) > 1 else 'it'} and keeps it only where it verifies and is "
        "faster"
    )


def _tried_text(ctx: Context, kernels: list[dict[str, Any]]) -> str:
    """Why a precision the peaks favour is not proposed: what timing it found."""
    left_out = [ctx.tried[p] for p in _narrower(ctx, kernels) if p in ctx.tried]
    return "".join(f"; {why}" for why in left_out)


def _roofs_text(ctx: Context, precisions: list[str], kernels: list[dict[str, Any]]) -> str:
    peak, precision = mixed_peak(kernels, ctx.peaks)
    parts = [
        f"{p} peak {_peak(ctx, p):.0f} {'GOP/s' if p == 'int8' else 'GFLOP/s'}" for p in precisions
    ]
    return "this CPU's " + ", ".join(parts) + f" vs {precision} {peak:.0f}"


def fp32_compute(ctx: Context) -> Finding | None:
    """MAC kernels in fp32 below the roof (those at it are `compute_bound`'s), where this
    machine computes int8 or bf16 markedly faster than fp32 and timing this model found
    nothing else."""
    chosen = ctx.free(
        [n for n in ctx.nodes if core_op(n["op_type"]) in MAC_OPS and n["precision"] == "fp32"]
    )
    fp32 = ctx.peaks.fp32_gflops
    lower = _lower_precisions(ctx, chosen, gain=lambda p: _peak(ctx, p) >= FASTER * fp32)
    if not lower:
        return None
    evidence = (
        f"{len(chosen)} fp32 MatMul/Conv kernels below the roof; "
        f"{_roofs_text(ctx, lower, chosen)}{_tried_text(ctx, chosen)}"
    )
    action = _try_narrower(ctx, lower)
    return _finding(
        ctx, "fp32-compute", "fp32 compute where int8/bf16 kernels exist", chosen, evidence, action
    )


def tried_precisions(benchmark: dict[str, Any] | None) -> dict[str, str]:
    """Precision → why it is not proposed, from an artifact's benchmark: `kiln optimize
    --precision auto` built, verified and timed a candidate in it for this model on this
    engine, and kept another (the faster, or the one with the lower P99 within noise)."""
    if not benchmark or "/" not in str(benchmark.get("choice", "")):
        return {}
    choice = benchmark["choice"]
    timed = benchmark.get("candidates") or {}
    out: dict[str, str] = {}
    for label, speedup in sorted(timed.items(), key=lambda item: -item[1]):
        precision = _precision_of(label)
        if "/" not in label or precision == _precision_of(choice) or precision in out:
            continue
        out[precision] = (
            f"{precision} not proposed: timed for this model when the artifact was built, "
            f"{label} ran {speedup:.2f}× ONNX Runtime as-is where the {choice} kept ran "
            f"{timed.get(choice, 0.0):.2f}×"
        )
    return out


def _precision_of(label: str) -> str:
    """`ort/int8+guard hand:ort-static` → int8."""
    return label.partition("/")[2].split(" ")[0].split("+")[0]


def below_roof(ctx: Context) -> Finding | None:
    """Compute-bound kernels well below their roof that no narrower precision would speed
    up (those are `fp32_compute`'s): the engine's kernel, not the machine, is the limit."""
    chosen = ctx.free(
        [
            n
            for n in ctx.nodes
            if n.get("bound") == "compute" and OVERHEAD <= n["efficiency"] < NEAR_ROOF
        ]
    )
    if not chosen:
        return None
    floor = sum(n["roofline_ms"] for n in chosen)
    spent = sum(n["median_ms"] for n in chosen)
    evidence = (
        f"{len(chosen)} compute-bound kernels reach {floor / spent:.0%} of their roof "
        f"together ({spent:.2f} ms per run where their roofs allow {floor:.2f} ms)"
    )
    action = (
        f"another engine's kernels: {_optimize(ctx, '--backend auto')} builds each engine "
        "and keeps the fastest; a machine busy with other work slows them too"
    )
    return _finding(ctx, "below-roof", "compute-bound below the roof", chosen, evidence, action)


def memory_bound(ctx: Context) -> Finding | None:
    chosen = ctx.free(
        [n for n in ctx.nodes if n.get("bound") == "memory" and n["efficiency"] >= OVERHEAD]
    )
    if not chosen:
        return None
    moved = sum(n["bytes"] for n in chosen)
    time_s = sum(n["median_ms"] for n in chosen) / 1e3
    # the bandwidth they could have had: each at the level its working set fits in
    bandwidth = ctx.peaks.bandwidth_gbs
    allowed_s = sum(n["bytes"] / (n.get("bandwidth_gbs", bandwidth) * 1e9) for n in chosen)
    levels = Counter(n.get("memory_level", "DRAM") for n in chosen)
    where = ", ".join(f"{count} in {level}" for level, count in sorted(levels.items()))
    evidence = (
        f"{len(chosen)} kernels below their ridge point, moving "
        f"{moved / time_s / 1e9 if time_s else 0:.1f} GB/s against the "
        f"{moved / allowed_s / 1e9 if allowed_s else 0:.0f} GB/s of where their working sets "
        f"fit ({where}){_tried_text(ctx, _macs(chosen))}"
    )
    action = f"fewer trips through memory: {_optimize(ctx)} fuses elementwise chains"
    # narrower values move fewer bytes, wherever the engine has kernels for them
    # where this CPU has fast kernels for them (int8: a dot-product instruction)
    fast = FASTER * ctx.peaks.fp32_gflops
    lower = _lower_precisions(ctx, _macs(chosen), gain=lambda p: _peak(ctx, p) >= fast)
    if lower:
        action += f"; narrower values move fewer bytes: {_try_narrower(ctx, lower)}"
    return _finding(ctx, "memory-bound", "memory-bound kernels", chosen, evidence, action)


def overhead_bound(ctx: Context) -> Finding | None:
    chosen = ctx.free([n for n in ctx.nodes if "efficiency" in n and n["efficiency"] < OVERHEAD])
    if not chosen:
        return None
    estimate = sum(n["roofline_ms"] for n in chosen)
    spent = sum(n["median_ms"] for n in chosen)
    evidence = (
        f"{len(chosen)} kernels take {spent:.2f} ms per run where the roofline allows "
        f"{estimate:.3f} ms (> {1 / OVERHEAD:.0f}× over): dispatch and thread wake-ups, "
        "not work"
    )
    action = (
        f"fewer, bigger kernels: {_optimize(ctx)} fuses small ops; for small models fewer "
        "intra-op threads cost less to wake"
    )
    return _finding(ctx, "overhead-bound", "overhead-bound small kernels", chosen, evidence, action)


def data_movement(ctx: Context) -> Finding | None:
    chosen = ctx.free([n for n in ctx.nodes if n["op_type"] in DATA_MOVEMENT])
    kinds = sorted({n["op_type"] for n in chosen})
    evidence = f"{len(chosen)} kernels only move data ({', '.join(kinds)})"
    action = (
        f"{_optimize(ctx)}: drop-noop-reshapes, detach-shape-reads and the fusions remove "
        "most of them; the rest follow the layout"
    )
    return _finding(ctx, "data-movement", "data movement", chosen, evidence, action)


def attention_chains(model: ir.Model) -> list[set[str]]:
    """Node names of each attention block written out as MatMul → (scale, mask) → Softmax →
    MatMul: the pattern fused attention kernels replace."""
    chains = []
    for node in model.graph:
        if node.op_type != "Softmax":
            continue
        above = _walk(node, _SCORE_PATH, up=True)
        below = _walk(node, _PROB_PATH, up=False)
        if above and below:
            chains.append({node.name, *above, *below})
    return chains


def _walk(start: ir.Node, through: set[str], up: bool, depth: int = 4) -> set[str]:
    """Names on a path from `start` to a MatMul through `through` ops; empty if none."""
    frontier: list[tuple[ir.Node, list[str]]] = [(start, [])]
    for _ in range(depth):
        step = []
        for node, path in frontier:
            if up:
                nexts = [v.producer() for v in node.inputs if v is not None and v.producer()]
            else:
                nexts = [user for v in node.outputs for user, _ in v.uses()]
            for other in nexts:
                if core_op(other.op_type) == "MatMul":
                    return {*path, other.name}
                if other.op_type in through:
                    step.append((other, [*path, other.name]))
        frontier = step
    return set()


def unfused_attention(ctx: Context) -> Finding | None:
    chains = attention_chains(ctx.model)
    chosen, blocks = [], 0
    for chain in chains:
        kernels = [n for n in ctx.nodes if chain & set(n["graph_nodes"])]
        # Unfused only if the engine really ran a Softmax kernel of its own.
        if any(n["op_type"] == "Softmax" for n in kernels):
            blocks += 1
            chosen += [n for n in ctx.free(kernels) if n not in chosen]
    evidence = (
        f"{blocks} attention blocks run as separate MatMul → Softmax → MatMul kernels "
        f"({len(chosen)} kernels), each writing its score matrix to memory"
    )
    action = f"{_optimize(ctx)} fuses each block into one MultiHeadAttention kernel"
    return _finding(ctx, "unfused-attention", "unfused attention", chosen, evidence, action)


def unfused_primitives(ctx: Context) -> Finding | None:
    """Kernels of the primitives LayerNorm and GELU are written with, in a model that has
    them: a ResNet's global average pool, run as a ReduceMean, is not a LayerNorm."""
    ops = {node.op_type for node in ctx.model.graph}
    if not ops & TELLTALE:
        return None
    graph_ops = {node.name: node.op_type for node in ctx.model.graph}
    chosen = ctx.free(
        [
            n
            for n in ctx.nodes
            if n["op_type"] in PRIMITIVES
            and all(graph_ops.get(g) in PRIMITIVES for g in n["graph_nodes"])
        ]
    )
    kinds = sorted({n["op_type"] for n in chosen})
    evidence = (
        f"{len(chosen)} kernels of primitive ops ({', '.join(kinds)}): normalisations or "
        "activations built op by op"
    )
    action = f"{_optimize(ctx)} fuses LayerNorm/GELU chains into single kernels"
    return _finding(
        ctx, "unfused-chains", "LayerNorm/GELU built of primitives", chosen, evidence, action
    )


def shape_nodes(model: ir.Model) -> set[str]:
    """Nodes that compute shapes at run time: Shape/Size and the arithmetic fed only by
    them and constants."""
    found: set[str] = set()
    for node in model.graph:  # topological order: producers come first
        if node.op_type in SHAPE_SOURCES:
            found.add(node.name)
            continue
        if node.op_type not in SHAPE_MATH:
            continue
        producers = [v.producer() for v in node.inputs if v is not None]
        data = [p for p in producers if p is not None and p.op_type != "Constant"]
        # Reshape's data input is real data: only its shape input may be shape math.
        if node.op_type == "Reshape":
            continue
        if data and all(p.name in found for p in data):
            found.add(node.name)
    return found


def dynamic_shapes(ctx: Context) -> Finding | None:
    computed = shape_nodes(ctx.model)
    chosen = ctx.free(
        [n for n in ctx.nodes if n["graph_nodes"] and set(n["graph_nodes"]) <= computed]
    )
    evidence = f"{len(chosen)} kernels compute shapes at run time (Shape → Gather/Concat/…)"
    action = (
        f"{_optimize(ctx)} folds shape arithmetic (detach-shape-reads, constant folding); give "
        "static shapes with --shape INPUT=AxB"
    )
    title = "dynamic-shape work at run time"
    return _finding(ctx, "dynamic-shapes", title, chosen, evidence, action)


def thread_underuse(ctx: Context) -> Finding | None:
    """Cores that nobody used while the model ran. Cores busy with other processes are not
    the engine's fault: on a shared machine that is noise, not a bottleneck."""
    if ctx.cores < 2 or ctx.idle_fraction is None or ctx.idle_fraction <= 1 - THREADS_USED:
        return None
    used = f"{ctx.cpu_utilization:.0%}" if ctx.cpu_utilization is not None else "?"
    return Finding(
        "thread-underuse",
        "cores idle during inference",
        share=ctx.idle_fraction,
        time_ms=ctx.idle_fraction * ctx.total_ms,
        evidence=(
            f"{ctx.idle_fraction:.0%} of the {ctx.cores} cores' time was idle while the model "
            f"ran (this process used {used} of them): kernels too small to split"
        ),
        action="larger batches (--batch) or concurrent requests (kiln serve batches them)",
    )


# Most specific cause first: each kernel is explained by the first rule that takes it.
RULES: list[Callable[[Context], Finding | None]] = [
    unfused_attention,
    unfused_primitives,
    dynamic_shapes,
    data_movement,
    overhead_bound,
    compute_bound,
    fp32_compute,
    below_roof,
    memory_bound,
    thread_underuse,
]


def diagnose(ctx: Context) -> list[Finding]:
    """Every rule's finding, largest share first."""
    findings = [f for rule in RULES if (f := rule(ctx)) is not None and f.share > 0]
    return sorted(findings, key=lambda f: f.share, reverse=True)
