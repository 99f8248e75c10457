"""Does ONNX Runtime run a fused op faster than the ops it replaces, here? Measured, not assumed.

A fusion into a contrib op is a bet on that op's CPU kernel: `SkipLayerNormalization` can run
several times slower than the Add, Add and LayerNormalization it replaces, enough to leave
bert-base's artifact slower than ORT as-is ("A fused op is a bet on its kernel" in
docs/contributing/engine-notes.md). So the fusion pass asks first: both forms are built at
the model's width, compiled as Kiln compiles for ORT (all of ORT's own optimizations but its
SkipLayerNormFusion, which would fuse the unfused form too; its default threads) and timed
interleaved (`ROUNDS` × `RUNS`, about 0.1 s); the fusion runs unless the fused form is slower
in every round. Remembered per width for the process.

`KILN_FUSED_OPS=fuse` in the environment skips the measurement and fuses wherever a rule
matches: the same graph on every machine (the tests run so).

Where the fusion is declined, the compiler also turns ORT's own SkipLayerNormFusion off in the
artifact's session options (`OrtOptions.disabled_optimizers`): given the shapes Kiln's graphs
state, ORT would otherwise make the same fusion itself, and lose the same time.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import onnx_ir as ir

from kiln.backends import get_backend
from kiln.backends.ort import OrtOptions
from kiln.timing import Speedup, interleave, speedups

ROWS = 128  # tokens: the zoo's sequence length; the ratio held from 128 to 4,096 rows
ROUNDS, RUNS = 7, 20
ENV = "KILN_FUSED_OPS"  # "measure" (the default) or "fuse"
SKIP_LAYERNORM_FUSION = "SkipLayerNormFusion"  # ORT's own optimizer making the same fusion


def skip_layernorm_slower(model: ir.Model) -> str | None:
    """None when ORT's SkipLayerNormalization is not slower than Add + Add +
    LayerNormalization at the widths of `model`'s LayerNormalizations; else why it is."""
    if os.environ.get(ENV, "measure") == "fuse":
        return None
    for width in sorted(_normalized_widths(model)):
        ratio = _fused_over_unfused(width)
        if ratio is not None:
            return (
                f"ONNX Runtime's SkipLayerNormalization runs {ratio:.2f}× as fast as Add + "
                f"LayerNormalization here ({ROWS} × {width}, measured): left unfused"
            )
    return None


def _normalized_widths(model: ir.Model) -> set[int]:
    """The widths of the last-axis LayerNormalizations, read from their scale (1-D, static
    even where the activations' shapes are not known)."""
    widths = set()
    for node in model.graph:
        if node.op_type != "LayerNormalization" or node.domain != "" or len(node.inputs) < 2:
            continue
        scale = node.inputs[1]
        shape = scale.shape if scale is not None else None
        if shape is not None and shape.rank() == 1 and isinstance(shape[0], int):
            widths.add(shape[0])
    return widths


@functools.cache
def _fused_over_unfused(width: int) -> float | None:
    """The fused form's speed over the unfused one's when slower in every round, else None."""
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal((1, ROWS, width), dtype=np.float32) for n in ("x", "skip")}
    fused = _fused_speedup(
        _skip_layernorm(width, False), _skip_layernorm(width, True), feeds,
        OrtOptions(disabled_optimizers=(SKIP_LAYERNORM_FUSION,)), ROUNDS, RUNS, warmup=3,
    )  # fmt: skip
    return fused.value if fused.verdict == "slower" else None


def _fused_speedup(
    parts: ir.Model, fused: ir.Model, feeds: dict, options: OrtOptions, rounds: int, runs: int,
    warmup: int,
) -> Speedup:  # fmt: skip
    """The fused form's speedup over its parts, both compiled by Kiln's ORT backend with
    `options` and timed interleaved."""
    ort = get_backend("ort")
    runners = {}
    for name, model in (("parts", parts), ("fused", fused)):
        exe = ort.compile(model, options)
        runners[name] = (lambda e: lambda: e.run(feeds))(exe)
    samples = interleave(runners, rounds=rounds, runs=runs, warmup=warmup)
    return speedups(samples, "parts")["fused"]


def _skip_layernorm(width: int, fused: bool) -> ir.Model:
    """y = LayerNorm(x + skip + bias): one SkipLayerNormalization, or Add, Add, LayerNorm."""
    rng = np.random.default_rng(0)
    float32 = ir.TensorType(ir.DataType.FLOAT)
    shape = ir.Shape([1, ROWS, width])
    x, skip = (ir.Value(name=n, type=float32, shape=shape) for n in ("x", "skip"))
    gamma, beta, bias = (
        ir.Value(name=n, const_value=ir.tensor(rng.standard_normal(width, dtype=np.float32)))
        for n in ("gamma", "beta", "bias")
    )
    if fused:
        nodes = [ir.node("SkipLayerNormalization", [x, skip, gamma, beta, bias],
                         domain="com.microsoft", attributes={"epsilon": 1e-12})]  # fmt: skip
    else:
        add = ir.node("Add", [x, skip])
        biased = ir.node("Add", [add.outputs[0], bias])
        norm = ir.node("LayerNormalization", [biased.outputs[0], gamma, beta],
                       attributes={"axis": -1, "epsilon": 1e-12})  # fmt: skip
        nodes = [add, biased, norm]
    out = nodes[-1].outputs[0]
    out.name, out.type, out.shape = "y", float32, shape
    graph = ir.Graph([x, skip], [out], nodes=nodes, initializers=[gamma, beta, bias],
                     opset_imports={"": 17, "com.microsoft": 1})  # fmt: skip
    return ir.Model(graph, ir_version=8)


FLASH_ROWS = 1024  # tokens from which the flash branch runs (and where it is timed)
FLASH_ROUNDS, FLASH_RUNS = 5, 4


def flash_attention_slower(heads: int, width: int) -> str | None:
    """None unless ORT's mask-free MultiHeadAttention (its CPU flash path), with the packed
    projection and Split before it, is slower than its Attention at `FLASH_ROWS` tokens in every
    round; else why the flash branch is not taken. Not slower at its shortest is enough: its
    lead grows with the length (benchmarks/flash_attention.py)."""
    if os.environ.get(ENV, "measure") == "fuse":
        return None
    ratio = _flash_over_attention(heads, width)
    if ratio.verdict != "slower":
        return None
    return (
        f"ONNX Runtime's flash MultiHeadAttention runs {ratio.value:.2f}× as fast as its "
        f"Attention here ({FLASH_ROWS} tokens × {width}, {heads} heads, measured): left as is"
    )


@functools.cache
def _flash_over_attention(heads: int, width: int) -> Speedup:
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((1, FLASH_ROWS, width), dtype=np.float32)}
    return _fused_speedup(
        _attention(heads, width, False), _attention(heads, width, True), feeds, OrtOptions(),
        FLASH_ROUNDS, FLASH_RUNS, warmup=1,
    )  # fmt: skip


def _attention(heads: int, width: int, flash: bool) -> ir.Model:
    """One self-attention layer over x [1, FLASH_ROWS, width]: Attention, or MatMul + Split +
    mask-free MultiHeadAttention."""
    rng = np.random.default_rng(0)
    float32 = ir.TensorType(ir.DataType.FLOAT)
    x = ir.Value(name="x", type=float32, shape=ir.Shape([1, FLASH_ROWS, width]))
    weight = ir.Value(name="w", const_value=ir.tensor(
        (rng.standard_normal((width, 3 * width)) * 0.05).astype(np.float32)))  # fmt: skip
    bias = ir.Value(name="b", const_value=ir.tensor(np.zeros(3 * width, np.float32)))
    sizes = ir.Value(name="sizes", const_value=ir.tensor(np.array([width] * 3)))
    if flash:
        packed = ir.node("MatMul", [x, weight])
        split = ir.node("Split", [packed.outputs[0], sizes], attributes={"axis": -1},
                        num_outputs=3)  # fmt: skip
        attend = ir.node("MultiHeadAttention", [*split.outputs, bias], domain="com.microsoft",
                         attributes={"num_heads": heads})  # fmt: skip
        nodes = [packed, split, attend]
    else:
        nodes = [ir.node("Attention", [x, weight, bias], domain="com.microsoft",
                         attributes={"num_heads": heads})]  # fmt: skip
    out = nodes[-1].outputs[0]
    out.name, out.type, out.shape = "y", float32, x.shape
    graph = ir.Graph([x], [out], nodes=nodes, initializers=[weight, bias, sizes],
                     opset_imports={"": 18, "com.microsoft": 1})  # fmt: skip
    return ir.Model(graph, ir_version=8)
