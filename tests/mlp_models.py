"""An MLP saved with external data: the model the memory tests compile and measure."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

WIDTH = 2048  # a WIDTH×WIDTH fp32 weight: 16 MiB


def write_mlp(path: Path, layers: int, width: int = WIDTH) -> Path:
    """`layers` MatMul + Relu of width×width random weights (random: nothing folds)."""
    rng = np.random.default_rng(layers)
    nodes, weights, previous = [], [], "x"
    for i in range(layers):
        weight = rng.standard_normal((width, width), dtype=np.float32) / width**0.5
        weights.append(numpy_helper.from_array(weight, f"w{i}"))
        nodes.append(helper.make_node("MatMul", [previous, f"w{i}"], [f"m{i}"]))
        nodes.append(helper.make_node("Relu", [f"m{i}"], [f"h{i}"]))
        previous = f"h{i}"
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
        [helper.make_tensor_value_info(previous, TensorProto.FLOAT, ["batch", width])], weights,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, path, save_as_external_data=True, location=f"{path.name}.data")
    return path
