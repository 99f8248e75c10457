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
    assert kiln.compile(path, tmp_path / "d.kiln", rounds=0).manifest.verification.ok


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


def _model(nodes, inputs, outputs, inits=()) -> ir.Model:
    graph = h.make_graph(nodes, "m", inputs, outputs, initializer=list(inits))
    return ir.serde.deserialize_model(h.make_model(graph, opset_imports=[h.make_opsetid("", 14)]))


def framed(width: int) -> ir.Model:
    """Runs only when the `frames` dim is a multiple of `width`: frames[batch, frames] is
    reshaped into rows of `width` samples."""
    return _model(
        [h.make_node("Reshape", ["x", "rows"], ["r"]),
         h.make_node("ReduceMax", ["r"], ["y"], keepdims=0, axes=[1])],
        [h.make_tensor_value_info("x", T.FLOAT, ["batch", "frames"])],
        [h.make_tensor_value_info("y", T.FLOAT, None)],
        [h.make_tensor("rows", T.INT64, [2], [-1, width])],
    )  # fmt: skip


def rated(name: str) -> ir.Model:
    """A voice-activity detector's interface: a window of 512 samples split into frames whose
    count is the scalar sample rate / 125 (runs at 16 kHz or 8 kHz, not at a random rate)."""
    return _model(
        [h.make_node("Div", [name, "per_frame"], ["size"]),
         h.make_node("Concat", ["size", "minus_one"], ["rows"], axis=0),
         h.make_node("Reshape", ["x", "rows"], ["r"], allowzero=1),
         h.make_node("ReduceMax", ["r"], ["y"], keepdims=0, axes=[1])],
        [h.make_tensor_value_info("x", T.FLOAT, [1, 512]),
         h.make_tensor_value_info(name, T.INT64, [1])],
        [h.make_tensor_value_info("y", T.FLOAT, None)],
        [h.make_tensor("per_frame", T.INT64, [1], [125]),
         h.make_tensor("minus_one", T.INT64, [1], [-1])],
    )  # fmt: skip


def test_a_dim_the_first_guess_gets_wrong_is_found_on_the_ladder(tmp_path):
    path = tmp_path / "framed.onnx"
    ir.save(framed(64), path)
    seen: list[str] = []
    artifact = kiln.compile(path, tmp_path / "f.kiln", rounds=0, progress=seen.append)
    verification = artifact.manifest.verification
    assert verification.ok and "frames=64" in verification.inputs, verification.inputs
    assert any("trying frames=64" in line for line in seen), seen


def test_a_scalar_input_gets_a_sample_rate_from_the_ladder(tmp_path):
    path = tmp_path / "rated.onnx"
    ir.save(rated("rate"), path)
    artifact = kiln.compile(path, tmp_path / "r.kiln", rounds=0)
    assert "rate=16000" in artifact.manifest.verification.inputs


def test_an_input_named_like_a_sample_rate_starts_at_16_khz():
    assert synthesize(rated("sr"))["sr"].tolist() == [16000]


def test_when_nothing_runs_the_error_names_what_to_pass(tmp_path):
    path = tmp_path / "framed.onnx"
    ir.save(framed(7777), path)
    with pytest.raises(kiln.KilnError) as info:
        kiln.compile(path, tmp_path / "f.kiln", rounds=0)
    message = str(info.value)
    assert "nor on 6 other guesses" in message and "Unresolved: dim frames" in message
    assert "--shape frames=N" in message and "\n" not in message
    assert not (tmp_path / "f.kiln").exists()


def test_an_input_too_big_for_this_machine_is_refused_before_numpy_tries():
    model = ir.serde.deserialize_model(zoo.build("bert-tiny"))
    with pytest.raises(kiln.KilnError, match="input 'input_ids' of shape 100000x100000 would"):
        synthesize(model, shapes={"input_ids": (100000, 100000)})


def image_model() -> ir.Model:
    """y = Relu(x), x float32[N, 3, 16, 16]: the channels and pixels are fixed."""
    return _model(
        [h.make_node("Relu", ["x"], ["y"])],
        [h.make_tensor_value_info("x", T.FLOAT, ["N", 3, 16, 16])],
        [h.make_tensor_value_info("y", T.FLOAT, None)],
    )


@pytest.mark.parametrize(
    ("given", "why", "example"),
    [
        ((1, 3, 16), "it has 4 dims, the --shape 3", "1x3x16x16"),
        ((2, 4, 16, 16), "its dim 1 is fixed at 3, the --shape gives 4", "2x3x16x16"),
    ],
)
def test_a_given_shape_the_model_refuses_is_named_with_the_shape_it_takes(
    tmp_path, given, why, example
):
    path = tmp_path / "image.onnx"
    ir.save(image_model(), path)
    with pytest.raises(kiln.KilnError) as info:
        kiln.compile(path, tmp_path / "i.kiln", rounds=0, shapes={"x": given})
    message = str(info.value)
    shape = "x".join(map(str, given))
    assert message.startswith(f"--shape x={shape} does not fit input 'x'"), message
    assert why in message and f"e.g. --shape x={example}." in message, message
    assert "Pass --shape" not in message
