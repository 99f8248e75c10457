"""Notes a user reads once and believes: a CNN's global average pool is not an unfused
LayerNorm, and an original changed since its artifact was built is said once by kiln debug."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper

import kiln
from kiln.debug.session import DebugSession
from kiln.passes.unfused_blocks import unfused_notes


def _model(nodes, shape, inits=()) -> ir.Model:
    graph = h.make_graph(
        nodes, "m", [h.make_tensor_value_info("x", T.FLOAT, shape)],
        [h.make_tensor_value_info("y", T.FLOAT, None)], list(inits),
    )  # fmt: skip
    return ir.serde.deserialize_model(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]))


def _scalar(name: str, value: float) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array(value, np.float32), name)


def test_a_global_average_pool_is_not_called_a_layer_norm():
    pooled = _model(  # torch's AdaptiveAvgPool2d(1) as the exporter writes it
        [h.make_node("ReduceMean", ["x", "axes"], ["y"], name="node_mean", keepdims=1)],
        [1, 8, 4, 4],
        [numpy_helper.from_array(np.array([2, 3], np.int64), "axes")],
    )
    assert unfused_notes(pooled) == []


def test_a_layer_norm_written_out_is_still_named_once():
    axes = numpy_helper.from_array(np.array([-1], np.int64), "axes")
    layer_norm = _model(
        [h.make_node("ReduceMean", ["x", "axes"], ["mean"], name="mean"),
         h.make_node("Sub", ["x", "mean"], ["centred"]),
         h.make_node("Pow", ["centred", "two"], ["square"]),
         h.make_node("ReduceMean", ["square", "axes"], ["variance"]),
         h.make_node("Add", ["variance", "eps"], ["shifted"]),
         h.make_node("Sqrt", ["shifted"], ["deviation"]),
         h.make_node("Div", ["centred", "deviation"], ["y"])],
        [2, 16],
        [axes, _scalar("two", 2.0), _scalar("eps", 1e-5)],
    )  # fmt: skip
    notes = unfused_notes(layer_norm)
    assert len(notes) == 1 and notes[0].startswith("LayerNorm at mean stayed unfused")


def test_an_original_changed_since_is_said_once_by_debug(tmp_path):
    path = tmp_path / "m.onnx"
    ir.save(_model([h.make_node("Relu", ["x"], ["y"], name="relu")], [1, 8]), path)
    kiln.compile(path, tmp_path / "m.kiln", rounds=0)
    ir.save(_model([h.make_node("Sigmoid", ["x"], ["y"], name="relu")], [1, 8]), path)
    session = DebugSession(str(tmp_path / "m.kiln"), profile_runs=0)
    said = [*session.summary()["notes"], *session.comparison()["notes"]]  # the page, the CLI
    assert sum("has changed since" in note for note in said) == 1, said
