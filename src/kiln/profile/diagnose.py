"""Bottleneck diagnosis: one small rule per class, each with its evidence and a Kiln action.

Every rule measures the share of the per-run kernel time its class accounts for; findings are
ranked by that share. Each kernel counts toward one finding only, the most specific cause
first (RULES' order): a Softmax inside an unfused attention block is the attention's, not
"memory-bound", so the shares add up to at most 100 %. Rules read the profiled kernels
(already placed on the roofline) and the graph the engine was given; none runs anything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import onnx_ir as ir

from kiln.profile.mapping import core_op

NEAR_ROOF = 0.4  # efficiency at which a kernel counts as running at the roof
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
SHAPE_SOURCES = {"Shape", "Size"}
SHAPE_MATH = {
    "Gather", "Concat", "Unsqueeze", "Squeeze", "Slice", "Cast", "Add", "Sub", "Mul", "Div",
    "Range", "Equal", "Where", "ConstantOfShape", "Reshape", "ReduceProd", "Min", "Max",
}  # fmt: skip
_SCORE_PATH = {"Add", "Div", "Mul", "Where", "Sub", "Cast"}  # between Q·Kᵀ and Softmax
_PROB_PATH = {"Cast", "Dropout", "Identity"}  # between Softmax and ·V


@dataclass
class Finding:
    kind: str
    title: str
    share: float  # of the per-run kernel time
    time_ms: float  # per run
    evidence: str
    action: str
    nodes: list[str] = field(default_factory=list)  # the slowest kernels concerned

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Context:
    nodes: list[dict[str, Any]]  # per-kernel entries, slowest first
    model: ir.Model  # the graph the engine was given
    source: str  # the original model (an artifact's source), for the commands we suggest
    peaks: Any
    cpu_utilization: float | None
    cores: int
    idle_fraction: float | None  # of all cores' time, used by no process at all
    claimed: set[str] = field(default_factory=set)  # kernels an earlier rule explained

    def free(self, chosen: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The kernels no earlier rule has explained."""
        return [n for n in chosen if n["node"] not in self.claimed]

    @property
    def total_ms(self) -> float:
        return sum(n["median_ms"] for n in self.nodes)


def _finding(ctx: Context, kind: str, title: str, chosen: list[dict], evidence: str, action: str):
    if not chosen:
        return None
    ctx.claimed.update(n["node"] for n in chosen)
    time_ms = sum(n["median_ms"] for n in chosen)
    share = time_ms / ctx.total_ms if ctx.total_ms > 0 else 0.0
    top = [n["node"] for n in sorted(chosen, key=lambda n: n["median_ms"], reverse=True)[:5]]
    return Finding(kind, title, share, time_ms, evidence, action, top)


def _optimize(ctx: Context, flags: str = "") -> str:
    return f"kiln optimize {ctx.source}{' ' + flags if flags else ''}"


def compute_bound(ctx: Context) -> Finding | None:
    near = ctx.free(
        [n for n in ctx.nodes if n.get("bound") == "compute" and n["efficiency"] >= NEAR_ROOF]
    )
    flops = sum(n["flops"] for n in near)
    time_s = sum(n["median_ms"] for n in near) / 1e3
    fp32 = [n for n in near if n["precision"] == "fp32"]
    faster = _lower_precision_roofs(ctx.peaks)
    action = (
        f"lower precision: {_optimize(ctx, '--precision int8')} or "
        f"{_optimize(ctx, '--backend openvino --precision bf16')} ({faster})"
        if fp32 and faster
        else "more cores or a faster machine: these kernels already run at the roof"
    )
    evidence = (
        f"{len(near)} kernels at ≥ {NEAR_ROOF:.0%} of their roof, "
        f"{flops / time_s / 1e9 if time_s else 0:.0f} GFLOP/s achieved against "
        f"{ctx.peaks.fp32_gflops:.0f} GFLOP/s fp32 peak"
    )
    return _finding(ctx, "compute-bound", "compute-bound near the roof", near, evidence, action)


def _lower_precision_roofs(peaks: Any) -> str:
    parts = []
    if peaks.int8_gops:
        parts.append(f"int8 peak {peaks.int8_gops:.0f} GOP/s")
    if peaks.bf16_gflops:
        parts.append(f"bf16 peak {peaks.bf16_gflops:.0f} GFLOP/s")
    if not parts:
        return ""
    return ", ".join(parts) + f" vs fp32 {peaks.fp32_gflops:.0f}"


def fp32_compute(ctx: Context) -> Finding | None:
    """MAC kernels in fp32 below the roof (those at it are `compute_bound`'s)."""
    faster = _lower_precision_roofs(ctx.peaks)
    if not faster:
        return None
    chosen = ctx.free(
        [n for n in ctx.nodes if core_op(n["op_type"]) in MAC_OPS and n["precision"] == "fp32"]
    )
    evidence = f"{len(chosen)} fp32 MatMul/Conv kernels below the roof; this CPU has {faster}"
    action = f"{_optimize(ctx, '--precision int8')} (accuracy-guarded)"
    return _finding(
        ctx, "fp32-compute", "fp32 compute where int8/bf16 kernels exist", chosen, evidence, action
    )


def memory_bound(ctx: Context) -> Finding | None:
    chosen = ctx.free(
        [n for n in ctx.nodes if n.get("bound") == "memory" and n["efficiency"] >= OVERHEAD]
    )
    moved = sum(n["bytes"] for n in chosen)
    time_s = sum(n["median_ms"] for n in chosen) / 1e3
    ridge = ctx.peaks.fp32_gflops / ctx.peaks.bandwidth_gbs
    evidence = (
        f"{len(chosen)} kernels below the ridge point ({ridge:.1f} FLOP/byte), moving "
        f"{moved / time_s / 1e9 if time_s else 0:.1f} GB/s against "
        f"{ctx.peaks.bandwidth_gbs:.0f} GB/s measured"
    )
    action = (
        f"fewer trips through memory: {_optimize(ctx)} fuses elementwise chains; "
        "bf16 activations halve the bytes "
        f"({_optimize(ctx, '--backend openvino --precision bf16')})"
    )
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
    chosen = ctx.free([n for n in ctx.nodes if n["op_type"] in PRIMITIVES])
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
    memory_bound,
    thread_underuse,
]


def diagnose(ctx: Context) -> list[Finding]:
    """Every rule's finding, largest share first."""
    findings = [f for rule in RULES if (f := rule(ctx)) is not None and f.share > 0]
    return sorted(findings, key=lambda f: f.share, reverse=True)
