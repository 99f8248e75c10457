"""Hostile model files never produce a traceback.

A seeded mutator damages a few small models, and artifacts built from them, one hostile class
at a time: truncated files, flipped bytes, unknown ops, missing or short initializers, NaN
weights, duplicate names, cycles, zero or 2⁴⁰ dims, string and other odd input types, no
outputs, opset 99, external data escaping the model's directory, empty graphs, broken
subgraphs, damaged attributes, odd names and damaged artifact files. Each case goes through
`kiln optimize`, `kiln run` or `kiln profile` the way the `kiln` command runs them (in-process,
for speed) and must end in a verified artifact / written outputs / a profile, or exit 2 with
one line on stderr: no traceback, no engine log line, no hang, nothing partial on disk.

A case is reproducible from its id alone: `verb-where-class-base-seed`. The default run checks
a fast sample; `-m slow` the full count.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.cli import main
from kiln.ir.inputs import synthesize

SAMPLE = 182  # two rounds of every (verb, where, class): well under a minute on two cores
FULL = 2184  # 24 rounds
CASE_SECONDS = 60  # a case slower than this counts as a hang

# ---------------------------------------------------------------- the base models


def _model(nodes, inputs, outputs, inits=(), opset: int = 17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _weights(seed: int, *shapes: tuple[int, ...]) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for shape in shapes]


def _mlp() -> onnx.ModelProto:
    """x[1,4] → MatMul → Add → (Relu → y, Sigmoid → z): weights, two outputs."""
    w, b = _weights(0, (4, 3), (3,))
    return _model(
        [
            helper.make_node("MatMul", ["x", "w"], ["h0"], name="mm"),
            helper.make_node("Add", ["h0", "b"], ["h"], name="add"),
            helper.make_node("Relu", ["h"], ["y"], name="relu"),
            helper.make_node("Sigmoid", ["h"], ["z"], name="sig"),
        ],
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [
            helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3]),
            helper.make_tensor_value_info("z", TensorProto.FLOAT, [1, 3]),
        ],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(b, "b")],
    )


def _embed() -> onnx.ModelProto:
    """ids int64[batch, seq] → Gather(table) → ReduceMean over seq → y[batch, 4]."""
    (table,) = _weights(1, (10, 4))
    axes = numpy_helper.from_array(np.array([1], np.int64), "axes")
    return _model(
        [
            helper.make_node("Gather", ["table", "ids"], ["e"], name="gather"),
            helper.make_node("ReduceMean", ["e", "axes"], ["y"], name="mean", keepdims=0),
        ],
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [numpy_helper.from_array(table, "table"), axes],
        opset=18,
    )


def _branchy() -> onnx.ModelProto:
    """y = x + w if sum(x) > 0 else x - w: an If whose branches read outer-scope values."""
    (w,) = _weights(2, (1, 4))
    out = helper.make_tensor_value_info("r", TensorProto.FLOAT, [1, 4])

    def branch(op: str, name: str) -> onnx.GraphProto:
        return helper.make_graph(
            [helper.make_node(op, ["x", "w"], ["r"], name=name)], name, [], [out]
        )

    return _model(
        [
            helper.make_node("ReduceSum", ["x"], ["s"], name="sum", keepdims=0),
            helper.make_node("Greater", ["s", "zero"], ["c"], name="gt"),
            helper.make_node(
                "If",
                ["c"],
                ["y"],
                name="if",
                then_branch=branch("Add", "then_add"),
                else_branch=branch("Sub", "else_sub"),
            ),
        ],  # fmt: skip
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.float32(0), "zero")],
    )


def _external() -> tuple[onnx.ModelProto, dict[str, bytes]]:
    """The MLP with its weights in 'weights.bin' next to the model."""
    model, data = _mlp(), b""
    for tensor in model.graph.initializer:
        raw = tensor.raw_data
        tensor.ClearField("raw_data")
        tensor.data_location = TensorProto.EXTERNAL
        info = {"location": "weights.bin", "offset": str(len(data)), "length": str(len(raw))}
        for key, value in info.items():
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        data += raw
    return model, {"weights.bin": data}


@cache
def base_files(base: str) -> dict[str, bytes]:
    """The base model's files: model.onnx and any external data beside it."""
    if base.startswith("zoo-"):
        from kiln import zoo

        return {"model.onnx": zoo.build(base[4:]).SerializeToString()}
    if base == "external":
        model, extra = _external()
        return {"model.onnx": model.SerializeToString(), **extra}
    builders = {"mlp": _mlp, "embed": _embed, "branchy": _branchy}
    return {"model.onnx": builders[base]().SerializeToString()}


# Small hand-built models most of the time; the tiny zoo models for real graphs.
BASES = {
    "mlp": 3,
    "embed": 2,
    "branchy": 2,
    "external": 2,
    "zoo-resnet-tiny": 1,
    "zoo-bert-tiny": 1,
}

# ---------------------------------------------------------------- the hostile classes


@dataclass(frozen=True)
class Link:
    """A symbolic link to write instead of a file."""

    target: str


Files = dict[str, "bytes | Link | None"]  # None: remove the file
Mutation = Callable[[random.Random, Files], None]
MODEL_CLASSES: dict[str, Mutation] = {}
ARTIFACT_CLASSES: dict[str, Mutation] = {}

HUGE = 1 << 40


def on_bytes(name: str, into: dict[str, Mutation] = MODEL_CLASSES):
    def register(fn: Mutation) -> Mutation:
        into[name] = fn
        return fn

    return register


def on_model(name: str):
    """Register a mutation of the parsed ModelProto (it may add files beside the model)."""

    def register(fn: Callable[[random.Random, onnx.ModelProto], Files | None]) -> Mutation:
        def apply(rng: random.Random, files: Files) -> None:
            model = onnx.load_from_string(files["model.onnx"])
            extra = fn(rng, model)
            files["model.onnx"] = model.SerializeToString()
            files.update(extra or {})

        MODEL_CLASSES[name] = apply
        return fn

    return register


def _graphs(graph: onnx.GraphProto) -> list[onnx.GraphProto]:
    found = [graph]
    for node in graph.node:
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.GRAPH:
                found += _graphs(attr.g)
            for sub in attr.graphs:
                found += _graphs(sub)
    return found


def _nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for g in _graphs(model.graph) for n in g.node]


def _pick_node(rng: random.Random, model: onnx.ModelProto) -> onnx.NodeProto | None:
    nodes = _nodes(model)
    return rng.choice(nodes) if nodes else None


def _value_names(model: onnx.ModelProto) -> list[str]:
    names = [v.name for v in model.graph.input] + [i.name for i in model.graph.initializer]
    return names + [o for n in _nodes(model) for o in n.output if o]


def _flip(rng: random.Random, data: bytes) -> bytes:
    if not data:
        return bytes([rng.randrange(256)])
    out = bytearray(data)
    for _ in range(rng.choice([1, 1, 2, 4, 16])):
        at = rng.randrange(len(out))
        out[at] = out[at] ^ (1 << rng.randrange(8)) if rng.random() < 0.5 else rng.randrange(256)
    return bytes(out)


def _truncate(rng: random.Random, data: bytes) -> bytes:
    cut = rng.choice([0, 1, 2, rng.randrange(max(len(data), 1)), max(len(data) - 1, 0)])
    return data[:cut]


def _a_file(rng: random.Random, files: Files, prefer: str = "model.onnx") -> str:
    names = [n for n, v in files.items() if isinstance(v, bytes)]
    return prefer if prefer in names and rng.random() < 0.7 else rng.choice(names)


@on_bytes("truncated")
def _truncated(rng: random.Random, files: Files) -> None:
    name = _a_file(rng, files)
    files[name] = _truncate(rng, files[name])


@on_bytes("flipped-bytes")
def _flipped(rng: random.Random, files: Files) -> None:
    name = _a_file(rng, files)
    files[name] = _flip(rng, files[name])


@on_model("unknown-op")
def _unknown_op(rng: random.Random, model: onnx.ModelProto) -> None:
    node = _pick_node(rng, model)
    how = rng.randrange(5)
    if how == 0:
        node.op_type = rng.choice(["FooBar", "", "relu", "Conv2D", "X" * 300, "Relu\nAdd"])
    elif how == 1:
        node.domain = rng.choice(["com.example", "com.microsoft", "ai.onnx.ml", "ai.onnx"])
        node.op_type = rng.choice(["FooBar", node.op_type])
        model.opset_import.append(helper.make_opsetid(node.domain, 1))
    elif how == 2:  # a known op with the wrong number of inputs or outputs
        node.op_type = rng.choice(["Relu", "Add", "MatMul", "Concat", "Split", "Where", "TopK"])
    elif how == 3:
        node.op_type = rng.choice(["Conv", "LSTM", "Resize", "NonMaxSuppression", "Einsum"])
    else:  # an op of a newer opset than the model declares
        node.op_type = rng.choice(["Gelu", "AffineGrid", "RMSNormalization", "Attention"])


@on_model("missing-initializer")
def _missing_initializer(rng: random.Random, model: onnx.ModelProto) -> None:
    inits = model.graph.initializer
    if not inits:
        node = _pick_node(rng, model)
        node.input.append("not_there")
        return
    victim = rng.randrange(len(inits))
    if rng.random() < 0.7:
        del inits[victim]
    else:
        inits[victim].name = rng.choice(["", "renamed", inits[0].name])


@on_model("short-initializer")
def _short_initializer(rng: random.Random, model: onnx.ModelProto) -> None:
    tensors = [t for g in _graphs(model.graph) for t in g.initializer]
    tensors += [a.t for n in _nodes(model) for a in n.attribute if a.HasField("t")]
    if not tensors:
        return
    tensor = rng.choice(tensors)
    how = rng.randrange(7)
    if how == 0 and tensor.raw_data:
        tensor.raw_data = tensor.raw_data[: rng.randrange(len(tensor.raw_data))]
    elif how == 1:
        tensor.dims.append(rng.choice([2, 3, 7]))
    elif how == 2 and tensor.dims:
        tensor.dims[rng.randrange(len(tensor.dims))] = rng.choice([0, -1, 1, HUGE])
    elif how == 3:
        tensor.ClearField("raw_data")
        tensor.float_data.extend([1.0] * rng.randrange(3))
    elif how == 4:
        tensor.data_type = rng.choice([0, 8, 11, 16, 17, 22, 99, -3])
    elif how == 5:
        tensor.ClearField("dims")
        tensor.dims.extend([rng.choice([2, 3]) for _ in range(rng.randrange(1, 4))])
    else:
        tensor.data_location = TensorProto.EXTERNAL  # claims external data, names none


@on_model("nan-weights")
def _nan_weights(rng: random.Random, model: onnx.ModelProto) -> None:
    inits = [
        t
        for t in model.graph.initializer
        if t.data_type == TensorProto.FLOAT and t.data_location != TensorProto.EXTERNAL
    ]
    for tensor in rng.sample(inits, k=min(len(inits), rng.randrange(1, 3))):
        array = numpy_helper.to_array(tensor).copy()
        fill = rng.choice([np.nan, np.inf, -np.inf, 3.4e38, 1e-45])
        if rng.random() < 0.5:
            array[...] = fill
        else:
            array.flat[rng.randrange(max(array.size, 1))] = fill
        tensor.CopyFrom(numpy_helper.from_array(array.astype(np.float32), tensor.name))


@on_model("duplicate-names")
def _duplicate_names(rng: random.Random, model: onnx.ModelProto) -> None:
    graph, how = model.graph, rng.randrange(6)
    nodes = list(graph.node)
    if how == 0 and len(nodes) > 1:  # two nodes write one value
        first, second = rng.sample(nodes, 2)
        second.output[0] = first.output[0]
    elif how == 1:
        graph.output.append(graph.output[0])
    elif how == 2 and graph.input:  # a node overwrites a graph input
        rng.choice(nodes).output[0] = graph.input[0].name
    elif how == 3 and graph.initializer:
        graph.initializer.append(graph.initializer[0])
    elif how == 4 and len(nodes) > 1:
        for node in nodes:
            node.name = "same"
    elif graph.initializer:  # a node writes over a weight
        rng.choice(nodes).output[0] = graph.initializer[0].name


@on_model("cycle")
def _cycle(rng: random.Random, model: onnx.ModelProto) -> None:
    graph = rng.choice([g for g in _graphs(model.graph) if g.node])
    nodes = list(graph.node)
    i = rng.randrange(len(nodes))
    j = rng.randrange(i, len(nodes))
    node = nodes[i]
    if not node.input:
        node.input.append(nodes[j].output[0])
    else:
        node.input[rng.randrange(len(node.input))] = nodes[j].output[0]


@on_model("dims")
def _dims(rng: random.Random, model: onnx.ModelProto) -> None:
    graph = model.graph
    values = [*graph.input, *graph.output, *graph.value_info]
    value = rng.choice(values)
    shape = value.type.tensor_type.shape
    if not shape.dim or rng.random() < 0.2:
        shape.dim.add().dim_value = rng.choice([0, HUGE])
        return
    dim = rng.choice(shape.dim)
    choice = rng.choice([0, HUGE, -1, -7, (1 << 62), "", " ", "batch size", "n\nm", "0"])
    if isinstance(choice, int):
        dim.dim_value = choice
    else:
        dim.dim_param = choice
    if rng.random() < 0.3:
        value.type.tensor_type.ClearField("shape")


ODD_TYPES = [
    TensorProto.STRING, TensorProto.STRING, TensorProto.BOOL, TensorProto.FLOAT16,
    TensorProto.BFLOAT16, TensorProto.COMPLEX64, TensorProto.FLOAT8E4M3FN, TensorProto.INT4,
    TensorProto.UINT64, TensorProto.DOUBLE, 0, 999,
]  # fmt: skip


@on_model("odd-types")
def _odd_types(rng: random.Random, model: onnx.ModelProto) -> None:
    graph = model.graph
    value = rng.choice([*graph.input, *graph.input, *graph.output])
    how = rng.randrange(5)
    if how < 3:  # string inputs above all
        value.type.tensor_type.elem_type = rng.choice(ODD_TYPES)
    elif how == 3:
        tensor = helper.make_tensor_type_proto(value.type.tensor_type.elem_type, None)
        value.type.CopyFrom(
            rng.choice([
                helper.make_sequence_type_proto(tensor),
                helper.make_optional_type_proto(tensor),
                helper.make_map_type_proto(TensorProto.INT64, tensor),
            ])
        )  # fmt: skip
    else:
        value.ClearField("type")


@on_model("no-outputs")
def _no_outputs(rng: random.Random, model: onnx.ModelProto) -> None:
    graph, how = model.graph, rng.randrange(5)
    if how == 0:
        graph.ClearField("output")
    elif how == 1:
        graph.output[0].name = "nowhere"
    elif how == 2 and graph.initializer:  # an output that is a weight
        graph.output[0].name = graph.initializer[0].name
    elif how == 3:  # an output that is an input
        graph.output[0].name = graph.input[0].name
    else:
        graph.output[0].name = ""


@on_model("opset")
def _opset(rng: random.Random, model: onnx.ModelProto) -> None:
    how = rng.randrange(6)
    default = next(o for o in model.opset_import if o.domain in ("", "ai.onnx"))
    if how == 0:
        default.version = 99
    elif how == 1:
        default.version = rng.choice([0, -1, 1, 6, HUGE])
    elif how == 2:
        model.ClearField("opset_import")
    elif how == 3:
        model.opset_import.append(helper.make_opsetid("", rng.choice([9, 99, 17])))
    elif how == 4:
        model.opset_import.append(helper.make_opsetid(rng.choice(["com.example", "x" * 200]), 1))
    else:
        model.ir_version = rng.choice([0, 1, 3, 99, -1])


@on_model("external-data")
def _external_data(rng: random.Random, model: onnx.ModelProto) -> Files:
    """Weights pointed outside the model's directory (the secret beside it), at missing or
    odd files, or with offsets and lengths that make no sense."""
    tensors = [t for g in _graphs(model.graph) for t in g.initializer]
    tensors += [a.t for n in _nodes(model) for a in n.attribute if a.HasField("t")]
    tensor = rng.choice(tensors)
    extra: Files = {}
    location = rng.choice([
        "../secret.bin", "{root}/secret.bin", "/etc/passwd", "sub/../../secret.bin", "link.bin",
        "dir/secret.bin", "", ".", "..", "weights.bin", "model.onnx", "missing.bin",
        "x" * 5000, "a\x00b", "file:///etc/passwd", "sub", "~/secret.bin",
    ])  # fmt: skip
    if location == "link.bin":
        extra["link.bin"] = Link("../secret.bin")
    elif location == "dir/secret.bin":
        extra["dir"] = Link("..")
    elif location == "sub":
        extra["sub/x"] = b"\0" * 8
    info = {"location": location}
    if rng.random() < 0.5:
        info["offset"] = rng.choice(["0", "8", "-4", "abc", str(HUGE), "1e3", ""])
    if rng.random() < 0.5:
        info["length"] = rng.choice(["0", "4", "-1", "xyz", str(HUGE), " 16"])
    tensor.ClearField("raw_data")
    tensor.ClearField("float_data")
    tensor.ClearField("int64_data")
    tensor.ClearField("external_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in info.items():
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return extra


@on_model("empty-graph")
def _empty_graph(rng: random.Random, model: onnx.ModelProto) -> None:
    graph, how = model.graph, rng.randrange(5)
    if how == 0:
        graph.ClearField("node")
    elif how == 1:
        graph.ClearField("node")
        graph.ClearField("output")
    elif how == 2:  # outputs straight from the inputs: nothing to compute
        graph.ClearField("node")
        for output in graph.output:
            output.CopyFrom(graph.input[0])
        del graph.output[1:]
    elif how == 3:
        graph.ClearField("node")
        graph.ClearField("input")
    else:
        model.graph.CopyFrom(onnx.GraphProto())


def _typed(model: onnx.ModelProto, name: str) -> onnx.ValueInfoProto:
    """`name`'s type as ONNX infers it (a branch output must have one), float if unknown."""
    inferred = onnx.shape_inference.infer_shapes(model).graph
    for value in [*inferred.value_info, *inferred.output, *inferred.input]:
        if value.name == name:
            return value
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, None)


def _if_around(rng: random.Random, model: onnx.ModelProto) -> onnx.NodeProto:
    """An If node: the model's own, or one wrapped around a node of the main graph."""
    ifs = [n for n in _nodes(model) if n.op_type in ("If", "Loop", "Scan")]
    if ifs:
        return rng.choice(ifs)
    graph = model.graph
    index = rng.randrange(len(graph.node))
    inner = graph.node[index]
    outs = [_typed(model, name) for name in inner.output]
    body = helper.make_graph([inner], "branch", [], outs)
    cond = numpy_helper.from_array(np.array(True), "cond_true")
    graph.initializer.append(cond)
    wrapper = helper.make_node(
        "If", ["cond_true"], list(inner.output), name="wrap",
        then_branch=body, else_branch=body,
    )  # fmt: skip
    graph.node.remove(inner)
    graph.node.insert(index, wrapper)
    return graph.node[index]  # the model's copy: protobuf copies what it inserts


@on_model("broken-subgraph")
def _broken_subgraph(rng: random.Random, model: onnx.ModelProto) -> None:
    node = _if_around(rng, model)
    graphs = [a for a in node.attribute if a.type == onnx.AttributeProto.GRAPH]
    attr = rng.choice(graphs)
    body, how = attr.g, rng.randrange(8)
    if how == 0:
        body.ClearField("node")
    elif how == 1:
        body.output[0].name = "nowhere"
    elif how == 2 and body.node:
        body.node[0].op_type = "FooBar"
    elif how == 3 and body.node:
        body.node[0].input[0] = "undefined_outer"
    elif how == 4:
        body.output.append(helper.make_tensor_value_info("extra", TensorProto.FLOAT, [1]))
    elif how == 5:
        node.attribute.remove(attr)
    elif how == 6:  # the attribute kept, its type changed
        attr.type = onnx.AttributeProto.INT
        attr.i = 3
    elif body.output:
        body.output[0].type.tensor_type.elem_type = TensorProto.STRING


@on_model("attributes")
def _attributes(rng: random.Random, model: onnx.ModelProto) -> None:
    node = _pick_node(rng, model)
    attrs = [a for a in node.attribute if a.type != onnx.AttributeProto.GRAPH]
    how = rng.randrange(5)
    if how == 0 or not attrs:
        node.attribute.append(
            rng.choice([
                helper.make_attribute("bogus", 1),
                helper.make_attribute("axis", rng.choice([HUGE, -HUGE, 99])),
                helper.make_attribute("perm", [5, 5, 5]),
                helper.make_attribute("to", 99),
            ])
        )  # fmt: skip
        return
    attr = rng.choice(attrs)
    if how == 1:
        node.attribute.remove(attr)
    elif how == 2:
        node.attribute.append(attr)  # twice
    elif how == 3:
        if attr.ints:
            attr.ints[rng.randrange(len(attr.ints))] = rng.choice([0, -1, HUGE, -HUGE])
        else:
            attr.i = rng.choice([0, -1, HUGE, -HUGE])
    else:
        attr.type = rng.choice([onnx.AttributeProto.STRING, onnx.AttributeProto.FLOATS, 0])


@on_model("odd-names")
def _odd_names(rng: random.Random, model: onnx.ModelProto) -> None:
    """Renames: one value everywhere (the model stays valid) or a node; names with newlines,
    markup, NULs, unicode, or thousands of characters."""
    name = rng.choice(
        ["", "a\nb", "[bold red]x[/]", ":boom:", "\x00", "ü→ℝ", "n" * 3000, "x y", "../../x"]
    )
    if rng.random() < 0.5:
        node = _pick_node(rng, model)
        node.name = name
        return
    old = rng.choice(_value_names(model))
    for graph in _graphs(model.graph):
        for value in [*graph.input, *graph.output, *graph.value_info, *graph.initializer]:
            if value.name == old:
                value.name = name
        for node in graph.node:
            node.input[:] = [name if n == old else n for n in node.input]
            node.output[:] = [name if n == old else n for n in node.output]


# ---------------------------------------------------------------- damaged artifacts


def _json_paths(data, path=()) -> list[tuple]:
    paths = [path]
    if isinstance(data, dict):
        for key, value in data.items():
            paths += _json_paths(value, (*path, key))
    elif isinstance(data, list):
        for index, value in enumerate(data):
            paths += _json_paths(value, (*path, index))
    return paths


ODD_JSON = [None, "", "x", -1, 0, 1e308, True, [], {}, [1, "a"], {"a": None}, "0" * 5000]


def _damage_json(rng: random.Random, text: bytes) -> bytes:
    data = json.loads(text)
    path = rng.choice(_json_paths(data)[1:] or [()])
    if not path:
        return json.dumps(rng.choice(ODD_JSON)).encode()
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    if rng.random() < 0.3:
        del parent[path[-1]]
    else:
        parent[path[-1]] = rng.choice(ODD_JSON)
    return json.dumps(data).encode()


@on_bytes("manifest", ARTIFACT_CLASSES)
def _manifest(rng: random.Random, files: Files) -> None:
    data = files["manifest.json"]
    how = rng.randrange(4)
    if how < 2:
        files["manifest.json"] = _damage_json(rng, data)
    elif how == 2:
        files["manifest.json"] = _flip(rng, data)
    else:
        files["manifest.json"] = _truncate(rng, data)


@on_bytes("provenance", ARTIFACT_CLASSES)
def _provenance(rng: random.Random, files: Files) -> None:
    data = files["provenance.json"]
    how = rng.randrange(3)
    if how == 0:
        files["provenance.json"] = _damage_json(rng, data)
    elif how == 1:
        files["provenance.json"] = _flip(rng, data)
    else:
        files["provenance.json"] = _truncate(rng, data)


@on_bytes("missing-file", ARTIFACT_CLASSES)
def _missing_file(rng: random.Random, files: Files) -> None:
    name = rng.choice(["manifest.json", "provenance.json", "model.onnx"])
    how = rng.randrange(3)
    if how == 0:
        files[name] = None
    elif how == 1:
        files[name] = b""
    else:
        files[name] = None
        files[f"{name}/x"] = b"a directory now"


# ---------------------------------------------------------------- the cases


VERBS = {"optimize": ["onnx"], "run": ["onnx", "artifact"], "profile": ["onnx", "artifact"]}


@dataclass(frozen=True)
class Case:
    verb: str
    where: str  # "onnx": a damaged model file; "artifact": a damaged NAME.kiln
    hostile: str
    base: str
    seed: int

    def __str__(self) -> str:
        return f"{self.verb}-{self.where}-{self.hostile}-{self.base}-{self.seed}"


def combos() -> list[tuple[str, str, str]]:
    out = []
    for verb, wheres in VERBS.items():
        for where in wheres:
            classes = [*MODEL_CLASSES, *(ARTIFACT_CLASSES if where == "artifact" else [])]
            out += [(verb, where, hostile) for hostile in classes]
    return out


def cases(count: int, seed: int) -> list[Case]:
    """`count` cases cycling through every (verb, where, class), each on a random base."""
    rng, every = random.Random(seed), combos()
    bases, weights = list(BASES), list(BASES.values())
    return [
        Case(*every[i % len(every)], rng.choices(bases, weights)[0], rng.randrange(1 << 30))
        for i in range(count)
    ]


# ---------------------------------------------------------------- running a case


@pytest.fixture(scope="module")
def shared_home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kiln-home")


@pytest.fixture(autouse=True)
def kiln_home(shared_home, monkeypatch) -> Path:
    """One KILN_HOME for the module: this machine's peaks are measured once, not per case."""
    monkeypatch.setenv("KILN_HOME", str(shared_home))
    return shared_home


class Artifacts:
    """Good artifacts and inputs of each base, built on first use."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def model_dir(self, base: str) -> Path:
        where = self.root / base
        if not where.is_dir():
            where.mkdir()
            for name, data in base_files(base).items():
                (where / name).write_bytes(data)
            artifact = kiln.compile(str(where / "model.onnx"), where / "model.kiln", rounds=0)
            feeds = synthesize(kiln.Session(artifact.path).interface)
            np.savez(where / "inputs.npz", **feeds)
        return where

    def artifact_files(self, base: str) -> dict[str, bytes]:
        path = self.model_dir(base) / "model.kiln"
        return {p.name: p.read_bytes() for p in path.iterdir()}

    def inputs(self, base: str) -> Path:
        return self.model_dir(base) / "inputs.npz"


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Artifacts:
    return Artifacts(tmp_path_factory.mktemp("bases"))  # built in a test, under its KILN_HOME


def write_files(where: Path, files: Files, root: Path) -> None:
    for name, data in files.items():
        path = where / name
        if data is None:
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, Link):
            path.symlink_to(data.target)
        else:
            path.write_bytes(data.replace(b"{root}", str(root).encode()))


def prepare(case: Case, artifacts: Artifacts, root: Path) -> list[str]:
    """Write the case's hostile files under `root`; return the `kiln` arguments."""
    rng = random.Random(case.seed)
    (root / "secret.bin").write_bytes(b"\x00" * 64)  # what an escaping location would read
    if case.where == "artifact":
        files: Files = dict(artifacts.artifact_files(case.base))
        folder, target = "model.kiln", "model.kiln"
    else:  # in a folder of its own, so that "../secret.bin" is outside it
        files = dict(base_files(case.base))
        folder, target = "m", "m/model.onnx"
    (MODEL_CLASSES | ARTIFACT_CLASSES)[case.hostile](rng, files)
    write_files(root / folder, files, root)
    shutil.copy(artifacts.inputs(case.base), root / "inputs.npz")
    if case.verb == "optimize":
        return ["optimize", target, "-o", "out.kiln", "--rounds", "0"]
    if case.verb == "run":
        return ["run", target, "--inputs", "inputs.npz", "-o", "out.npz"]
    return ["profile", target, "--runs", "1", "--rounds", "1", "--json"]


@dataclass
class Outcome:
    code: int
    out: str
    err: str
    seconds: float


@contextmanager
def plain_process():
    """Python warnings and log records reach stderr as they would in a plain `kiln` process:
    no handler but Python's last resort, the interpreter's default warning filters (pytest
    would otherwise capture both, and hide lines a user sees)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    root = logging.getLogger()
    root.addHandler(handler)
    with warnings.catch_warnings():
        warnings.resetwarnings()  # no filter: each warning shown once per place ("default")
        for hidden_by_default in (
            DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning
        ):  # fmt: skip
            warnings.simplefilter("ignore", hidden_by_default)
        warnings.showwarning = _show_warning
        try:
            yield
        finally:
            root.removeHandler(handler)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def kiln_cli(args: list[str], cwd: Path, capfd, monkeypatch) -> Outcome:
    """`kiln ARGS` as the console script runs it, in this process; an exception escaping
    `main` is what the user would see as a traceback."""
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["kiln", *args])
    capfd.readouterr()
    start = time.monotonic()
    try:
        with plain_process():
            main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:  # noqa: BLE001 - the interpreter would print it and exit 1
        traceback.print_exc()
        code = 1
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    seconds = time.monotonic() - start
    captured = capfd.readouterr()
    return Outcome(code, captured.out, captured.err, seconds)


def snapshot(root: Path) -> dict[str, bytes | str | None]:
    """Every path under `root` → its bytes (None: a directory; str: a link's target)."""
    found: dict[str, bytes | str | None] = {}
    for top, dirs, names in os.walk(root):
        for name in dirs + names:
            path = Path(top, name)
            key = str(path.relative_to(root))
            if path.is_symlink():
                found[key] = os.readlink(path)
            else:
                found[key] = None if path.is_dir() else path.read_bytes()
    return found


def hidden(root: Path) -> list[str]:
    return [str(p) for p in root.rglob(".*")]


ENGINE_LOG = ("[E:onnxruntime", "[W:onnxruntime", "[I:onnxruntime", "onnxruntime::")


def check(case: Case, outcome: Outcome, root: Path, before: dict) -> None:
    """Exit 0 with the verb's whole result, or exit 2 with one line; never anything else."""
    said = outcome.out + outcome.err
    tail = "\n".join(said.splitlines()[-12:])  # a traceback's last frames and its error
    assert "Traceback" not in said, tail
    assert not any(marker in said for marker in ENGINE_LOG), said
    assert outcome.seconds < CASE_SECONDS, f"{case} took {outcome.seconds:.0f} s"
    assert outcome.code in (0, 2), said
    after = snapshot(root)
    new = {k: v for k, v in after.items() if k not in before}
    assert {k: after.get(k) for k in before} == before, "the input files were changed"
    if outcome.code == 2:
        lines = outcome.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), outcome.err
        assert not outcome.out.strip(), outcome.out
        assert not new, f"left behind: {sorted(new)}"
        return
    assert not outcome.err.strip(), outcome.err  # success says nothing on stderr
    if case.verb == "optimize":
        assert all(k == "out.kiln" or k.startswith("out.kiln/") for k in new), sorted(new)
        artifact = kiln.artifact.read_artifact(root / "out.kiln")
        assert artifact.manifest.verification is not None and artifact.manifest.verification.ok
    elif case.verb == "run":
        assert set(new) == {"out.npz"}, sorted(new)
        with np.load(root / "out.npz", allow_pickle=False) as data:
            assert data.files
    else:
        assert not new, sorted(new)
        assert "latency" in json.loads(outcome.out)


def run_case(case: Case, artifacts: Artifacts, root: Path, home: Path, capfd, monkeypatch):
    args = prepare(case, artifacts, root)
    before = snapshot(root)
    outcome = kiln_cli(args, root, capfd, monkeypatch)
    check(case, outcome, root, before)
    assert not hidden(home), f"temporary files left in KILN_HOME: {hidden(home)}"


@pytest.mark.timeout(2 * CASE_SECONDS)
@pytest.mark.parametrize("case", cases(SAMPLE, seed=0), ids=str)
def test_hostile_file(case, artifacts, tmp_path, kiln_home, capfd, monkeypatch):
    run_case(case, artifacts, tmp_path, kiln_home, capfd, monkeypatch)


@pytest.mark.slow
@pytest.mark.timeout(2 * CASE_SECONDS)
@pytest.mark.parametrize("case", cases(FULL, seed=1), ids=str)
def test_hostile_file_full(case, artifacts, tmp_path, kiln_home, capfd, monkeypatch):
    run_case(case, artifacts, tmp_path, kiln_home, capfd, monkeypatch)


def test_every_class_is_sampled():
    """The fast sample reaches every verb, place and hostile class."""
    sampled = {(c.verb, c.where, c.hostile) for c in cases(SAMPLE, seed=0)}
    assert sampled == set(combos())
    assert len(cases(FULL, seed=1)) >= 2000
