"""Non-causal Attention takes ONNX Runtime's flash path only where that changes nothing: an
all-ones mask and a long sequence; padded or short requests run the original node
(kiln.passes.flash_attention)."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

import kiln
from kiln.cost import count_flops
from kiln.hardware import Peaks
from kiln.ir.inputs import synthesize
from kiln.ir.load import load_model
from kiln.passes import flash_attention, fused_op_pays
from kiln.passes.flash_attention import FlashAttentionPass
from kiln.profile import profile_model
from kiln.timing import Speedup

WIDTH, HEADS, ROWS = 32, 4, 8


def _layer(causal: bool = False, length: int = 64, opset: int = 18) -> ir.Model:
    """x [1, S, 32] and a 2-D mask → one com.microsoft Attention with packed weights."""
    rng = np.random.default_rng(0)
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([1, "S", WIDTH]))
    mask = ir.Value(name="mask", type=ir.TensorType(ir.DataType.INT32), shape=ir.Shape([1, "S"]))
    weight = ir.Value(name="w", const_value=ir.tensor(
        rng.standard_normal((WIDTH, 3 * WIDTH)).astype(np.float32) * 0.3))  # fmt: skip
    bias = ir.Value(name="b", const_value=ir.tensor(
        rng.standard_normal(3 * WIDTH).astype(np.float32) * 0.1))  # fmt: skip
    node = ir.node("Attention", [x, weight, bias, mask], domain="com.microsoft",
                   attributes={"num_heads": HEADS, "unidirectional": int(causal)})  # fmt: skip
    out = node.outputs[0]
    out.name, out.type, out.shape = "y", x.type, x.shape
    graph = ir.Graph([x, mask], [out], nodes=[node], initializers=[weight, bias], name="layer",
                     opset_imports={"": opset, "com.microsoft": 1})  # fmt: skip
    model = ir.Model(graph, ir_version=8)
    model.metadata_props["kiln.dims"] = json.dumps({"S": length})  # as a compile's fit records
    return model


def _session(model: ir.Model) -> ort.InferenceSession:
    proto = ir.serde.serialize_model(model).SerializeToString()
    return ort.InferenceSession(proto, providers=["CPUExecutionProvider"])


def _masks(rows: int) -> dict[str, np.ndarray]:
    padded = np.ones((1, rows), np.int32)
    padded[0, rows // 2 :] = 0
    return {"ones": np.ones((1, rows), np.int32), "padded": padded}


@pytest.fixture
def short_threshold(monkeypatch):
    monkeypatch.setattr(flash_attention, "FLASH_ROWS", ROWS)


@pytest.mark.parametrize("opset", [13, 18])
def test_outputs_match_for_every_mask_and_length(short_threshold, opset):
    original, wrapped = _session(_layer(opset=opset)), _layer(opset=opset)
    rewrites = FlashAttentionPass()(wrapped)
    assert rewrites.modified
    session = _session(wrapped)
    x_rng = np.random.default_rng(1)
    for rows in (ROWS // 2, ROWS * 3):  # below and above the threshold
        x = x_rng.standard_normal((1, rows, WIDTH)).astype(np.float32)
        for name, mask in _masks(rows).items():
            feeds = {"x": x, "mask": mask}
            expected, got = original.run(None, feeds)[0], session.run(None, feeds)[0]
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5, err_msg=name)


def test_the_long_unmasked_branch_is_mask_free_multihead_attention(short_threshold):
    model = _layer()
    FlashAttentionPass()(model)
    (choice,) = [n for n in model.graph if n.op_type == "If"]
    then_ops = [(n.op_type, len([i for i in n.inputs if i is not None])) for n in
                choice.attributes["then_branch"].as_graph()]  # fmt: skip
    else_ops = [n.op_type for n in choice.attributes["else_branch"].as_graph()]
    assert ("MultiHeadAttention", 4) in then_ops  # query, key, value, bias: no mask
    assert else_ops == ["Attention"]
    # The FLOPs are still counted (the If costs as its costlier branch).
    proto = ir.serde.serialize_model(model)
    assert count_flops(proto, {"S": 64}) == count_flops(ir.serde.serialize_model(_layer()),
                                                        {"S": 64})  # fmt: skip


def test_a_model_compiled_for_short_sequences_is_left_as_it_is(short_threshold):
    model = _layer(length=ROWS - 1)
    assert FlashAttentionPass()(model).modified is False
    assert [n.op_type for n in model.graph] == ["Attention"]


def test_a_model_below_opset_13_is_left_as_it_is(short_threshold):
    model = _layer(opset=12)
    assert FlashAttentionPass()(model).modified is False


def test_causal_attention_is_left_as_it_is(short_threshold):
    model = _layer(causal=True)
    assert FlashAttentionPass()(model).modified is False
    assert [n.op_type for n in model.graph] == ["Attention"]


def test_it_declines_where_the_flash_path_is_slower(monkeypatch, short_threshold):
    monkeypatch.setenv(fused_op_pays.ENV, "measure")
    planted = Speedup(0.8, (0.75, 0.85), "slower")
    monkeypatch.setattr(fused_op_pays, "_flash_over_attention", lambda heads, width: planted)
    model, kiln_pass = _layer(), FlashAttentionPass()
    assert kiln_pass(model).modified is False
    assert "0.80× as fast" in kiln_pass.note and "left as is" in kiln_pass.note


def test_the_measurement_times_both_forms_through_the_engine():
    ratio = fused_op_pays._flash_over_attention.__wrapped__(2, 16)
    assert ratio.value > 0 and ratio.verdict in ("faster", "slower", "no different within noise")


def test_a_compiled_bert_keeps_its_outputs_through_either_branch(tmp_path, short_threshold):
    artifact = kiln.compile("zoo:bert-tiny", tmp_path / "bert.kiln", rounds=0)
    assert artifact.manifest.verification.ok
    model = ir.load(str(artifact.model_path))
    assert Counter(n.op_type for n in model.graph)["If"] >= 2
    original = _session(load_model("zoo:bert-tiny").model)
    session = kiln.Session(artifact.path)
    feeds = synthesize(model, dims={"seq": 16})
    padded = {k: v.copy() for k, v in feeds.items()}
    padded["attention_mask"][:, 8:] = 0
    for request in (feeds, padded):
        expected = original.run(None, request)
        for got, want in zip(session.run(None, request), expected, strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)
    session.close()


def test_a_profile_counts_each_layer_once_and_never_the_if_itself(tmp_path, short_threshold):
    artifact = kiln.compile("zoo:bert-tiny", tmp_path / "bert.kiln", rounds=0)
    peaks = Peaks(fp32_gflops=100.0, bf16_gflops=200.0, int8_gops=400.0, bandwidth_gbs=20.0,
                  threads=2, measured_at="test")  # fmt: skip
    result = profile_model(str(artifact.path), runs=3, rounds=1, peaks=peaks)
    ops = Counter(n["op_type"] for n in result["nodes"])
    assert "If" not in ops  # its time is its branch's kernels', already counted
    layers = Counter(n.op_type for n in ir.load(str(artifact.model_path)).graph)["If"]
    assert ops["MultiHeadAttention"] == layers  # one row a layer, not one shared name
