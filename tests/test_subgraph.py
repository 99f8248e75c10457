"""kiln.ir.subgraph.extract: two pieces of a model chain back to the whole, provenance kept."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

from kiln.errors import KilnError
from kiln.ir import ORIGIN_KEY, load_model, stamp_origins
from kiln.ir.subgraph import extract


def _session(model: ir.Model) -> ort.InferenceSession:
    return ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString())


@pytest.fixture(scope="module")
def resnet() -> ir.Model:
    model = load_model("zoo:resnet-tiny").model
    stamp_origins(model)
    return model


def test_two_pieces_compute_the_whole(resnet: ir.Model) -> None:
    graph = resnet.graph
    cut = list(graph)[len(graph) // 2].outputs[0].name
    head = extract(resnet, ["input"], [cut], "edge")
    tail = extract(resnet, [cut], ["logits"], "server")
    assert len(head.graph) + len(tail.graph) == len(graph)
    x = np.random.default_rng(0).random((2, 3, 32, 32), dtype=np.float32)
    whole = _session(resnet).run(None, {"input": x})[0]
    middle = _session(head).run(None, {"input": x})[0]
    np.testing.assert_array_equal(_session(tail).run(None, {cut: middle})[0], whole)
    assert all(ORIGIN_KEY in node.metadata_props for node in tail.graph)
    assert len(resnet.graph) == len(graph)  # the caller's model is untouched


def test_a_cut_that_leaves_a_path_around_names_it(resnet: ir.Model) -> None:
    early = list(resnet.graph)[2].outputs[0].name
    late = list(resnet.graph)[30].outputs[0].name
    with pytest.raises(KilnError, match="does not separate the graph.*'input'"):
        extract(resnet, [late], [early])
    with pytest.raises(KilnError, match="'nope' is not a tensor"):
        extract(resnet, ["input"], ["nope"])


def test_a_model_output_can_start_a_piece(resnet: ir.Model) -> None:
    graph = resnet.graph
    cut = list(graph)[len(graph) // 2].outputs[0]
    both = ir.serde.deserialize_model(ir.serde.serialize_model(resnet))
    both.graph.outputs.append(both.graph.node(len(graph) // 2).outputs[0])  # also given back
    tail = extract(both, [cut.name], ["logits"], "server")
    assert [v.name for v in tail.graph.inputs] == [cut.name]
    assert [v.name for v in tail.graph.outputs] == ["logits"]
