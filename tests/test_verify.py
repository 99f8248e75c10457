"""Verification judges what a user would: NaN and infinities alike on both sides are equal
(fp16 overflow, empty-set reductions, the -inf logits behind an attention mask), a NaN or inf on
one side only is a failure that says so, and string inputs come from an .npz of numpy text.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper

import kiln
from kiln.errors import KilnError
from kiln.ir.inputs import check_feeds, read_calibration, read_inputs
from kiln.verify import (
    FP32_TOLERANCE,
    NOISE_FACTOR,
    SCALE_FLOOR,
    Budget,
    check_output,
    compare,
    cosine,
    max_abs_diff,
    relative_max_abs,
    top1,
)

NAN, INF = float("nan"), float("inf")


def f32(*values: float) -> np.ndarray:
    return np.array(values, np.float32)


def verdict(ref: np.ndarray, new: np.ndarray, precision: str = "fp32", metric: str = "cosine"):
    """One output 'y', one input set, judged as a compile judges it."""
    return compare(["y"], [[ref]], [[new]], "given", precision, budget=Budget(metric))


# ---------------------------------------------------------------- fp32: max-abs under a bound


@pytest.mark.parametrize(
    "values",
    [
        pytest.param(f32(1.0, NAN, 2.0), id="both-nan"),
        pytest.param(f32(1.0, INF, 2.0), id="both-plus-inf"),
        pytest.param(f32(-INF, 1.0, -INF), id="both-minus-inf"),
        pytest.param(f32(NAN, INF, -INF), id="nothing-finite"),
    ],
)
def test_non_finite_values_alike_on_both_sides_are_equal(values):
    check = check_output("y", values, values.copy(), FP32_TOLERANCE)
    assert check.ok and check.max_abs == 0.0 and check.problem is None
    assert max_abs_diff(values, values.copy()) == 0.0
    assert verdict(values, values.copy()).ok


def test_float16_overflow_alike_on_both_sides_is_equal():
    with np.errstate(over="ignore"):
        ref = np.array([65504, 1e5, -1e5, 1.0], np.float32).astype(np.float16)  # → inf, -inf
    assert np.isinf(ref).sum() == 2
    assert check_output("y", ref, ref.copy(), FP32_TOLERANCE).ok


def test_opposite_infinities_fail_and_say_so():
    result = verdict(f32(INF, 1.0), f32(-INF, 1.0))
    assert not result.ok
    assert result.summary() == (
        "output 'y': 1 value is -inf in the compiled model but +inf in the original"
    )
    assert max_abs_diff(f32(INF, 1.0), f32(-INF, 1.0)) == INF


def test_nan_on_one_side_fails_with_a_clear_summary():
    ref = f32(1.0, 2.0, 3.0, 4.0, 5.0)
    new = f32(NAN, NAN, NAN, 4.0, 5.0)
    result = verdict(ref, new)
    assert not result.ok
    assert result.summary() == (
        "output 'y': 3 values are NaN in the compiled model but finite in the original"
    )


def test_each_kind_of_non_finite_mismatch_is_counted():
    ref = f32(NAN, 1.0, 1.0, INF, INF, 1.0)
    new = f32(1.0, INF, INF, NAN, 2.0, 1.0)
    check = check_output("y", ref, new, FP32_TOLERANCE)
    assert not check.ok and check.max_abs == INF
    assert check.problem == (
        "2 values are +inf in the compiled model but finite in the original; "
        "1 value is NaN in the compiled model but +inf in the original; "
        "1 value is finite in the compiled model but NaN in the original; "
        "1 value is finite in the compiled model but +inf in the original"
    )


def test_masked_logits_get_a_bound_from_the_finite_values():
    logits = f32(2.0, -INF, 4.0, -INF, -1.0)
    scale = 4.0  # the largest finite |logit|; the -inf of the mask count for nothing
    close = logits + f32(0.5, 0, 0, 0, 0) * FP32_TOLERANCE * scale
    check = check_output("y", logits, close, FP32_TOLERANCE)
    assert check.ok
    assert check.scale == scale and check.bound == FP32_TOLERANCE * scale
    assert check.max_abs == pytest.approx(0.5 * FP32_TOLERANCE * scale, rel=1e-3)

    far = logits + f32(0, 0, 2, 0, 0) * FP32_TOLERANCE * scale  # twice the bound, finite
    result = verdict(logits, far)
    assert not result.ok
    assert result.outputs[0].max_abs == pytest.approx(2 * FP32_TOLERANCE * scale, rel=1e-3)
    assert result.summary() == (
        f"output 'y' max abs error {2 * FP32_TOLERANCE * scale:.3g}, "
        f"bound {FP32_TOLERANCE * scale:.3g}"
    )


def test_engine_noise_that_is_not_finite_does_not_widen_the_bound():
    ref, new = f32(1.0, 2.0), f32(1.0, 2.5)
    assert not check_output("y", ref, new, FP32_TOLERANCE, noise=INF).ok
    noisy = check_output("y", ref, new, FP32_TOLERANCE, noise=0.2)
    assert noisy.ok and noisy.bound == pytest.approx(NOISE_FACTOR * 0.2)


@pytest.mark.parametrize("shape", [(0,), (0, 4), (3, 0)])
def test_empty_outputs_are_equal(shape):
    empty = np.zeros(shape, np.float32)
    check = check_output("y", empty, empty.copy(), FP32_TOLERANCE)
    assert check.ok and check.max_abs == 0.0 and check.scale == SCALE_FLOOR
    assert max_abs_diff(empty, empty.copy()) == 0.0
    assert cosine(empty, empty.copy()) == 1.0
    assert top1(empty, empty.copy()) == 1.0
    assert relative_max_abs(empty, empty.copy()) == 1.0
    assert verdict(empty, empty.copy(), "bf16").ok


def test_integer_outputs_match_exactly():
    ids = np.array([3, 1, 4, 1], np.int64)
    assert check_output("y", ids, ids.copy(), FP32_TOLERANCE).ok
    off = ids + np.array([0, 1, 0, 0])
    result = verdict(ids, off)
    assert not result.ok
    assert result.summary() == "output 'y': 1 of 4 values differ; int64 outputs must match exactly"
    assert not check_output("y", ids > 1, off > 1, FP32_TOLERANCE).ok  # bool: one flips


def test_string_outputs_match_exactly():
    words = np.array(["kiln", "fires", "clay"], dtype=object)
    assert check_output("y", words, words.copy(), FP32_TOLERANCE).ok
    other = np.array(["kiln", "fires", "CLAY"], dtype=object)
    check = check_output("y", words, other, FP32_TOLERANCE)
    assert not check.ok
    assert check.problem == "1 of 3 values differ; string outputs must match exactly"


def test_another_shape_fails_and_says_so():
    result = verdict(f32(1.0, 2.0), f32(1.0, 2.0, 3.0))
    assert not result.ok
    assert result.summary() == "output 'y': shape [3] in the compiled model but [2] in the original"


def test_sequence_outputs_are_checked_element_by_element():
    ref = [f32(1.0, -INF), f32(NAN)]
    assert check_output("y", ref, [a.copy() for a in ref], FP32_TOLERANCE).ok
    check = check_output("y", ref, [f32(1.0, -INF), f32(0.0)], FP32_TOLERANCE)
    assert check.problem == (
        "element 1: 1 value is finite in the compiled model but NaN in the original"
    )
    short = check_output("y", ref, ref[:1], FP32_TOLERANCE)
    assert short.problem == "a sequence of 1 tensors in the compiled model but 2 in the original"
    assert max_abs_diff(ref, [f32(1.0, INF), f32(NAN)]) == INF


# ---------------------------------------------------------------- lower precisions: metrics


def test_cosine_leaves_out_masked_positions():
    logits = np.array([[2.0, -INF, 1.0], [-INF, -INF, -INF]], np.float32)  # row 2: all masked
    assert cosine(logits, logits.copy()) == pytest.approx(1.0)
    assert cosine(logits, logits + np.float32(1e-6)) == pytest.approx(1.0)
    result = verdict(logits, logits.copy(), "bf16")
    assert result.ok and result.threshold == pytest.approx(0.99)  # a finite bar


def test_cosine_fails_where_the_mask_differs():
    logits = np.array([[2.0, -INF, 1.0]], np.float32)
    unmasked = np.array([[2.0, 0.0, 1.0]], np.float32)
    assert np.isnan(cosine(logits, unmasked))
    result = verdict(logits, unmasked, "bf16")
    assert not result.ok
    assert result.summary() == (
        "output 'y': 1 value is finite in the compiled model but -inf in the original"
    )


@pytest.mark.parametrize("metric", ["top1", "max-abs"])
def test_every_metric_holds_non_finite_values_alike(metric):
    logits = np.array([[2.0, -INF, 1.0]] * 200, np.float32)
    assert verdict(logits, logits.copy(), "bf16", metric).ok
    one_nan = logits.copy()
    one_nan[7, 0] = NAN  # 1 sample in 200: top-1 alone would still pass its 99 % bar
    result = verdict(logits, one_nan, "bf16", metric)
    assert not result.ok
    assert result.summary() == (
        "output 'y': 1 value is NaN in the compiled model but finite in the original"
    )


def test_metrics_score_a_mismatch_as_a_failure():
    ref, new = f32(1.0, -INF, 3.0), f32(1.0, 0.0, 3.0)
    assert relative_max_abs(ref, new) == -INF
    assert relative_max_abs(ref, ref.copy()) == 1.0
    assert top1(ref[None], new[None]) == 0.0
    assert top1(ref[None], ref[None].copy()) == 1.0


def test_integer_outputs_follow_the_task_metric_below_fp32():
    logits, ids = f32(0.1, 0.9), np.array([1, 2], np.int64)
    result = compare(["p", "i"], [[logits, ids]], [[logits, ids + 1]], "given", "bf16")
    assert result.ok  # exact equality is asked at fp32 only, as before


# ---------------------------------------------------------------- string inputs from an .npz


def string_model() -> onnx.ModelProto:
    """y = x without the stopword "the": a string[N] input, a string[M] output."""
    x = helper.make_tensor_value_info("x", TensorProto.STRING, ["N"])
    y = helper.make_tensor_value_info("y", TensorProto.STRING, ["M"])
    node = helper.make_node(
        "StringNormalizer", ["x"], ["y"], case_change_action="NONE", is_case_sensitive=1,
        stopwords=["the"],
    )  # fmt: skip
    graph = helper.make_graph([node], "strings", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_unicode_arrays_feed_string_inputs(tmp_path):
    model = ir.serde.deserialize_model(string_model())
    np.savez(tmp_path / "in.npz", x=np.array(["Hello", "wörld"]))  # dtype <U5: no pickle
    feeds = read_inputs(str(tmp_path / "in.npz"), model)
    assert feeds["x"].dtype == object and feeds["x"].tolist() == ["Hello", "wörld"]


def test_utf8_byte_arrays_feed_string_inputs():
    model = ir.serde.deserialize_model(string_model())
    feeds = {"x": np.array(["wörld".encode(), b"ok"])}  # dtype S6
    check_feeds(model, feeds)
    assert feeds["x"].dtype == object and feeds["x"].tolist() == ["wörld", "ok"]
    with pytest.raises(KilnError) as info:
        check_feeds(model, {"x": np.array([b"\xff", b"ok"])}, where="in.npz")
    assert str(info.value) == (
        "in.npz: input 'x' holds bytes that are not UTF-8 text (invalid start byte); ONNX "
        "strings are UTF-8. Save the strings as a numpy text array, e.g. "
        "np.array(texts, dtype=str)."
    )


def test_calibration_stacks_of_unicode_arrays(tmp_path):
    model = ir.serde.deserialize_model(string_model())
    np.savez(tmp_path / "calib.npz", x=np.array([["a", "b"], ["c", "d"], ["e", "f"]]))
    samples = read_calibration(str(tmp_path / "calib.npz"), model)
    assert [s["x"].tolist() for s in samples] == [["a", "b"], ["c", "d"], ["e", "f"]]
    assert all(s["x"].dtype == object for s in samples)


def test_pickled_object_arrays_are_refused_with_what_to_do(tmp_path):
    model = ir.serde.deserialize_model(string_model())
    np.savez(tmp_path / "in.npz", x=np.array(["a", "b"], dtype=object))  # pickled by numpy
    with pytest.raises(KilnError) as info:
        read_inputs(str(tmp_path / "in.npz"), model)
    assert str(info.value) == (
        f"{tmp_path / 'in.npz'}: array 'x' is a pickled object array, which Kiln does not "
        "load. Save strings as a numpy text array, e.g. np.array(texts, dtype=str), and other "
        "inputs with their numeric dtype."
    )


def test_text_for_a_numeric_input_keeps_its_message(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [x])
    model = ir.serde.deserialize_model(helper.make_model(graph))
    with pytest.raises(KilnError) as info:
        check_feeds(model, {"x": np.array(["1", "2"])}, where="in.npz")
    assert str(info.value) == (
        "in.npz: input 'x' has dtype <U1, expected float32[2]. Convert it with .astype('float32')."
    )


# ---------------------------------------------------------------- end to end


def test_string_model_compiles_verified_from_a_unicode_npz(tmp_path):
    texts = np.array(["the", "kiln", "wörld"])  # dtype <U5
    np.savez(tmp_path / "in.npz", x=texts)
    artifact = kiln.compile(
        string_model(), tmp_path / "s.kiln", inputs=tmp_path / "in.npz", rounds=0
    )
    verification = artifact.manifest.verification
    assert verification.ok and verification.inputs == str(tmp_path / "in.npz")
    assert verification.outputs[0].problem is None
    [kept] = kiln.Session(artifact.path).run(None, {"x": texts})
    assert kept.tolist() == ["kiln", "wörld"]


def masked_scores_model() -> onnx.ModelProto:
    """scores = Where(mask, x, -inf) and probs = Softmax(scores): float32[2, 8] each; a row
    masked throughout gives -inf scores and NaN probabilities in any correct engine."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])
    mask = helper.make_tensor_value_info("mask", TensorProto.BOOL, [2, 8])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 8]) for n in ("s", "p")]
    minus_inf = helper.make_tensor("minus_inf", TensorProto.FLOAT, [], [-np.inf])
    nodes = [
        helper.make_node("Where", ["mask", "x", "minus_inf"], ["s"], name="masking"),
        helper.make_node("Softmax", ["s"], ["p"], name="softmax", axis=-1),
    ]
    graph = helper.make_graph(nodes, "masked", [x, mask], outs, [minus_inf])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_masked_minus_inf_scores_compile_verified(tmp_path):
    mask = np.ones((2, 8), bool)
    mask[0, 5:] = False  # padding
    mask[1, :] = False  # a row with nothing to attend to
    x = np.random.default_rng(0).standard_normal((2, 8)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x, mask=mask)
    artifact = kiln.compile(
        masked_scores_model(), tmp_path / "m.kiln", inputs=tmp_path / "in.npz", rounds=0
    )
    verification = artifact.manifest.verification
    assert verification.ok
    scores, probs = (o for o in verification.outputs)
    assert np.isfinite(scores.bound) and scores.scale == pytest.approx(np.abs(x[mask]).max())
    assert np.isfinite(probs.bound) and probs.max_abs <= probs.bound
    got_scores, got_probs = kiln.Session(artifact.path).run(None, {"x": x, "mask": mask})
    assert np.isneginf(got_scores[~mask]).all() and np.isnan(got_probs[1]).all()
