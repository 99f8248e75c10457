"""Models of strings shared by the serving tests (not a test module)."""

from __future__ import annotations

from pathlib import Path

import onnx
from onnx import TensorProto, helper


def strings_model(path: Path) -> Path:
    """text: STRING [n] → upper: STRING [n] (ASCII upper-cased), count: INT64 [1]."""
    text = helper.make_tensor_value_info("text", TensorProto.STRING, ["n"])
    upper = helper.make_tensor_value_info("upper", TensorProto.STRING, ["n"])
    count = helper.make_tensor_value_info("count", TensorProto.INT64, [1])
    nodes = [
        helper.make_node(
            "StringNormalizer", ["text"], ["upper"], case_change_action="UPPER", locale="C"
        ),
        helper.make_node("Shape", ["text"], ["count"]),
    ]
    graph = helper.make_graph(nodes, "strings", [text], [upper, count])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, path)
    return path
