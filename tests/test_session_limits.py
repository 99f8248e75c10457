"""A session knows the largest size each dim of its model takes (a position table's length)
and refuses a request past it before the engine runs; its checks run once per request
signature, with the same refusals as ever."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
import kiln.runtime.session as session_module
from kiln import zoo
from kiln.errors import KilnError
from kiln.ir.inputs import synthesize
from kiln.runtime.monitor import FOLD_EVERY


def _table_rows(name: str, table: str) -> int:
    """Rows of a zoo model's initializer: the limit comes from the model, not from here."""
    model = zoo.build(name)
    (found,) = [t for t in model.graph.initializer if t.name == table]
    return int(found.dims[0])


def _text_feeds(batch: int, seq: int, names: list[str]) -> dict[str, np.ndarray]:
    feeds = {n: np.zeros((batch, seq), np.int64) for n in names}
    if "attention_mask" in feeds:
        feeds["attention_mask"][:] = 1
    return feeds


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:  # module-scoped: its own KILN_HOME
        patch.setenv("KILN_HOME", str(tmp_path_factory.mktemp("home")))
        with kiln.Session("zoo:bert-tiny", keep_requests=8) as session:
            yield session


@pytest.mark.parametrize(
    "model, table",
    [
        ("bert-tiny", "embeddings.position_embeddings.weight"),  # Slice(position_ids, 0, seq)
        ("gpt2-tiny", "transformer.wpe.weight"),  # Gather(wpe, Range(0, seq))
    ],
)
def test_a_position_table_bounds_seq_in_the_metadata(model, table):
    limit = _table_rows(model, table)
    with kiln.Session(f"zoo:{model}") as session:
        assert session.limits["seq"].limit == limit
        assert {i["name"]: i["max_shape"] for i in session.inputs}["input_ids"] == [-1, limit]
        assert session.inputs[0]["shape"] == [-1, -1]  # KServe's shape stays as declared


def test_a_request_past_the_limit_is_refused_before_it_runs(bert):
    limit = bert.limits["seq"].limit
    before = bert.stats()["requests"]
    with pytest.raises(KilnError) as refused:
        bert.run(None, _text_feeds(1, limit + 1, bert.input_names))
    message = str(refused.value)
    assert f"input 'input_ids' has seq={limit + 1}" in message
    assert f"at most seq={limit}" in message and "position" in message
    assert bert.stats()["requests"] == before  # the engine never ran it
    assert len(bert.recent_requests()) == 0  # nor is it kept for replay
    outputs = bert.run(None, _text_feeds(2, limit, bert.input_names))
    assert outputs[0].shape[:2] == (2, limit)
    assert len(bert.recent_requests()) == 1


def test_models_without_a_limit_get_none():
    with kiln.Session("zoo:resnet-tiny") as session:
        assert session.limits == {}
        assert "max_shape" not in session.inputs[0]  # KServe's metadata, nothing added


def test_a_table_of_one_row_broadcasts_and_bounds_nothing(tmp_path):
    """Slice(bias[1, 4], axes=[0], ends=[batch]) is 1 row whatever the batch: not a limit."""
    path = tmp_path / "broadcast.onnx"
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Slice", ["shape", "zero", "one"], ["batch"]),
        helper.make_node("Slice", ["bias", "zero", "batch", "zero"], ["row"]),
        helper.make_node("Add", ["x", "row"], ["y"]),
    ]
    initializers = [
        numpy_helper.from_array(np.zeros((1, 4), np.float32), "bias"),
        numpy_helper.from_array(np.array([0], np.int64), "zero"),
        numpy_helper.from_array(np.array([1], np.int64), "one"),
    ]
    graph = helper.make_graph(
        nodes,
        "broadcast",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        initializers,
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    with kiln.Session(str(path)) as session:
        assert session.limits == {}
        (y,) = session.run(None, {"x": np.ones((3, 4), np.float32)})
        assert y.shape == (3, 4)


def test_checks_run_once_per_signature_and_still_refuse(bert, monkeypatch):
    calls = []
    original = session_module.checked_feeds
    monkeypatch.setattr(session_module, "checked_feeds", lambda *a: calls.append(1) or original(*a))
    names = bert.input_names
    for _ in range(5):
        bert.run(None, _text_feeds(1, 8, names))
    assert len(calls) == 1
    bert.run(None, _text_feeds(1, 9, names))  # a new shape: checked once more
    assert len(calls) == 2
    # What the kept verdicts must not hide: each bad request is still refused, clearly.
    good = _text_feeds(1, 8, names)
    wrong_dtype = {**good, "input_ids": good["input_ids"].astype(np.int32)}
    with pytest.raises(KilnError, match="input 'input_ids' has dtype int32"):
        bert.run(None, wrong_dtype)
    with pytest.raises(KilnError, match="unknown input 'ids'"):
        bert.run(None, {**good, "ids": good["input_ids"]})
    with pytest.raises(KilnError, match="missing input 'token_type_ids'"):
        bert.run(None, {k: v for k, v in good.items() if k != "token_type_ids"})
    with pytest.raises(KilnError, match="inputs sharing a dim must agree"):
        bert.run(None, {**good, "attention_mask": np.ones((1, 7), np.int64)})
    with pytest.raises(KilnError, match="feeds must be a dict"):
        bert.run(None, [good])


def test_stats_count_every_run_however_they_are_folded():
    with kiln.Session("zoo:resnet-tiny") as session:
        feeds = synthesize(session.interface)
        runs = FOLD_EVERY + 3  # some folded by the recording thread, the rest by stats()
        for _ in range(runs):
            session.run(None, feeds)
        stats = session.stats()
        assert stats["requests"] == stats["misses"] == runs
        assert stats["buckets"]["dynamic"]["runs"] == runs
