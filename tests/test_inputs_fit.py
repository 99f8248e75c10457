"""Synthesized inputs that fit together: a named dim has one value in every input, `--shape`
binds the dims of the input it names for every input sharing them, or a dim by its name."""

from __future__ import annotations

import onnx_ir as ir
import pytest
from onnx import TensorProto as T
from onnx import helper as h

import kiln
from kiln import zoo
from kiln.ir.inputs import synthesize


def decoder() -> ir.Model:
    """A decoder's interface: memory[batch, src_len, 256] and src_mask[batch, src_len]."""
    nodes = [
        h.make_node("ReduceSum", ["memory"], ["pooled"], keepdims=0, axes=[2]),
        h.make_node("Cast", ["src_mask"], ["mask"], to=T.FLOAT),
        h.make_node("Mul", ["pooled", "mask"], ["out"]),
    ]
    graph = h.make_graph(
        nodes, "decoder",
        [h.make_tensor_value_info("memory", T.FLOAT, ["batch", "src_len", 256]),
         h.make_tensor_value_info("src_mask", T.INT64, ["batch", "src_len"])],
        [h.make_tensor_value_info("out", T.FLOAT, ["batch", "src_len"])],
    )  # fmt: skip
    return ir.serde.deserialize_model(h.make_model(graph, opset_imports=[h.make_opsetid("", 11)]))


def shapes(feeds) -> dict[str, tuple[int, ...]]:
    return {name: value.shape for name, value in feeds.items()}


def test_a_named_dim_has_one_value_in_every_input(tmp_path):
    feeds = synthesize(decoder())
    assert feeds["memory"].shape[:2] == feeds["src_mask"].shape
    # ... so the model runs on them, and compiles verified.
    path = tmp_path / "decoder.onnx"
    ir.save(decoder(), path)
    assert kiln.compile(path, tmp_path / "d.kiln").manifest.verification.ok


def test_shape_of_one_input_binds_the_inputs_sharing_its_dims():
    model = ir.serde.deserialize_model(zoo.build("bert-tiny"))
    got = shapes(synthesize(model, shapes={"input_ids": (2, 32)}))
    assert set(got.values()) == {(2, 32)}, got


def test_a_dim_may_be_given_by_its_name():
    model = ir.serde.deserialize_model(zoo.build("bert-tiny"))
    got = shapes(synthesize(model, shapes={"seq": (24,)}))
    assert {s[1] for s in got.values()} == {24}, got


def test_a_shape_naming_nothing_lists_the_inputs_and_dims():
    model = ir.serde.deserialize_model(zoo.build("bert-tiny"))
    with pytest.raises(kiln.KilnError, match="neither an input .* inputs: input_ids, "):
        synthesize(model, shapes={"bogus": (3,)})
    with pytest.raises(kiln.KilnError, match="'seq' is a dim; give one size"):
        synthesize(model, shapes={"seq": (2, 3)})
