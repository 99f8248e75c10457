"""The model zoo: every model builds, checks, is deterministic and runs in ONNX Runtime."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from kiln import zoo
from kiln.errors import KilnError
from kiln.zoo import bert, gpt2

TINY = [n for n in zoo.names() if zoo.entry(n).tiny]
FULL = [n for n in zoo.names() if not zoo.entry(n).tiny]
BATCHED_SEQ = 512  # the longest sequence the batch-of-three check runs


def _vocab(model: onnx.ModelProto) -> int:
    """Rows of the table the token ids index (the first Gather on ``input_ids``)."""
    inits = {t.name: t for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Gather" and node.input[1] == "input_ids":
            return inits[node.input[0]].dims[0]
    raise AssertionError("no embedding Gather on input_ids")


def _feeds(model: onnx.ModelProto, dims: dict[str, int], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for vi in model.graph.input:
        shape = [d.dim_value or dims[d.dim_param] for d in vi.type.tensor_type.shape.dim]
        if vi.name == "input_ids":
            feeds[vi.name] = rng.integers(0, _vocab(model), shape, dtype=np.int64)
        elif vi.name == "attention_mask":
            feeds[vi.name] = np.ones(shape, np.int64)
        elif vi.name == "token_type_ids":
            feeds[vi.name] = np.zeros(shape, np.int64)
        else:
            feeds[vi.name] = rng.random(shape, dtype=np.float32)
    return feeds


def _check(name: str) -> None:
    e = zoo.entry(name)
    model = zoo.build(name)
    onnx.checker.check_model(model, full_check=True)
    assert model.producer_name == "kiln.zoo"
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 17)]
    assert all(n.domain in ("", "ai.onnx") for n in model.graph.node)
    props = {p.key: p.value for p in model.metadata_props}
    assert props["kiln.zoo"] == name
    assert json.loads(props["kiln.dims"]) == e.dims
    node_names = [n.name for n in model.graph.node]
    assert all(node_names) and len(set(node_names)) == len(node_names)
    symbolic = {d.dim_param for vi in model.graph.input for d in vi.type.tensor_type.shape.dim} - {
        ""
    }
    assert symbolic == set(e.dims)
    assert model.SerializeToString() == zoo.build(name).SerializeToString()  # deterministic

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for batch in (e.dims["batch"], 3):
        dims = {**e.dims, "batch": batch}
        if batch > 1 and "seq" in dims:  # three 4,096-token rows would need ≈ 10 GiB of scores
            dims["seq"] = min(dims["seq"], BATCHED_SEQ)
        a = sess.run(None, _feeds(model, dims, seed=1))
        b = sess.run(None, _feeds(model, dims, seed=2))
        for out, other, vi in zip(a, b, model.graph.output, strict=True):
            assert out.shape[0] == batch
            want = [d.dim_value or dims[d.dim_param] for d in vi.type.tensor_type.shape.dim]
            assert list(out.shape) == want, vi.name
            assert np.isfinite(out).all(), vi.name
            assert out.std() > 1e-3, f"{vi.name} is constant"
            assert 1e-3 < np.abs(out).max() < 1e3, vi.name
            assert not np.allclose(out, other), f"{vi.name} does not depend on the input"
        if batch > 1:  # each sample is computed on its own
            assert not np.allclose(a[0][0], a[0][1])


def test_names_full_first() -> None:
    names = zoo.names()
    assert set(FULL) == {
        "resnet50",
        "mobilenetv2",
        "bert-base",
        "bert-base-4k",
        "gpt2",
        "unet3d",
        "vit-b16",
        "two-tower",
    }
    assert names == FULL + TINY
    assert set(TINY) == {
        "resnet-tiny",
        "mobilenetv2-tiny",
        "bert-tiny",
        "gpt2-tiny",
        "unet3d-tiny",
        "vit-tiny",
        "two-tower-tiny",
    }


def test_entries() -> None:
    for name in zoo.names():
        e = zoo.entry(name)
        assert e.name == name and e.description and e.dims["batch"] >= 1
        assert e.tiny == name.endswith("-tiny")
        assert (e.published_gflops is not None) == (not e.tiny)
        if not e.tiny:
            assert e.published_source
    assert zoo.entry("bert-base").dims == {"batch": 1, "seq": 128}
    assert zoo.entry("gpt2").dims == {"batch": 1, "seq": 128}
    assert zoo.entry("bert-base-4k").dims == {"batch": 1, "seq": 4096}


def test_unknown_model_names_the_known_ones() -> None:
    with pytest.raises(KilnError) as info:
        zoo.entry("resnet51")
    assert "resnet51" in str(info.value)
    assert all(n in str(info.value) for n in zoo.names())
    with pytest.raises(KilnError):
        zoo.build("nope")


@pytest.mark.parametrize("name", TINY)
def test_tiny_model(name: str) -> None:
    _check(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", FULL)
def test_full_model(name: str) -> None:
    _check(name)


def test_transformer_patterns() -> None:
    """The attention layout the fusion rules look for (see kiln.zoo._builder.attention_core)."""
    cfg = bert.TINY  # what zoo:bert-tiny is built from
    model = zoo.build("bert-tiny")
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("LayerNormalization") == 1 + 2 * cfg.layers  # embeddings, then 2 a layer
    assert ops.count("Erf") == cfg.layers and ops.count("Softmax") == cfg.layers
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    reshapes = {tuple(inits[n.input[1]]) for n in model.graph.node if n.op_type == "Reshape"}
    assert reshapes == {(0, 0, cfg.heads, cfg.hidden // cfg.heads), (0, 0, cfg.hidden)}
    perms = {
        tuple(a.ints) for n in model.graph.node if n.op_type == "Transpose" for a in n.attribute
    }
    assert perms == {(0, 2, 1, 3), (0, 2, 3, 1)}
    gpt = zoo.build("gpt2-tiny")
    gops = [n.op_type for n in gpt.graph.node]
    assert all(gops.count(op) == gpt2.TINY.layers for op in ("Split", "Where", "Tanh")), gops
    head = [n for n in gpt.graph.node if n.name == "lm_head.Transpose"]
    assert head and head[0].input[0] == "transformer.wte.weight"  # tied to the embedding


def _session(name: str) -> ort.InferenceSession:
    model = zoo.build(name).SerializeToString()
    return ort.InferenceSession(model, providers=["CPUExecutionProvider"])


def test_gpt2_is_causal_and_takes_any_length() -> None:
    sess = _session("gpt2-tiny")
    ids = np.random.default_rng(0).integers(0, 1000, (2, 9), dtype=np.int64)
    mask = np.ones_like(ids)
    a = sess.run(None, {"input_ids": ids, "attention_mask": mask})[0]
    ids[:, -1] = (ids[:, -1] + 1) % 1000
    b = sess.run(None, {"input_ids": ids, "attention_mask": mask})[0]
    assert a.shape == (2, 9, 1000)
    np.testing.assert_allclose(a[:, :-1], b[:, :-1], atol=1e-5)  # the past ignores the future
    assert not np.allclose(a[:, -1], b[:, -1])


def test_bert_padding_mask_hides_tokens() -> None:
    sess = _session("bert-tiny")
    ids = np.random.default_rng(0).integers(0, 1000, (1, 7), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[:, -2:] = 0
    feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
    a = sess.run(None, feeds)
    ids[:, -1] = (ids[:, -1] + 1) % 1000
    b = sess.run(None, feeds)
    np.testing.assert_allclose(a[0][:, :-2], b[0][:, :-2], atol=1e-5)
    np.testing.assert_allclose(a[1], b[1], atol=1e-5)
