"""kiln.runtime: shape buckets, padding safety, run_batch, stats, hot swap, adaptive rebuilds."""

from __future__ import annotations

import threading

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import kiln
from kiln.errors import KilnError
from kiln.runtime import parse_buckets

RNG = np.random.default_rng(0)


def bert_feeds(batch: int, seq: int, valid: int | None = None) -> dict[str, np.ndarray]:
    """bert-tiny inputs; `valid` < seq masks the tail out, as a tokenizer's padding would."""
    mask = np.ones((batch, seq), np.int64)
    if valid is not None:
        mask[:, valid:] = 0
    return {
        "input_ids": RNG.integers(0, 1000, (batch, seq)).astype(np.int64),
        "attention_mask": mask,
        "token_type_ids": np.zeros((batch, seq), np.int64),
    }


def reference(session: kiln.Session) -> ort.InferenceSession:
    """Plain ONNX Runtime on the same model file, dynamic shapes, nothing padded."""
    return ort.InferenceSession(session._source.model_path, providers=["CPUExecutionProvider"])


def assert_same(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    # Module-scoped, so built before the per-test KILN_HOME of conftest: give it its own.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KILN_HOME", str(tmp_path_factory.mktemp("home")))
        session = kiln.Session("zoo:bert-tiny", buckets={"batch": [1, 4, 8], "seq": [8, 16, 32]})
        yield session
        session.close()


def test_parse_buckets():
    assert parse_buckets("batch=8,1,4  seq=32,64") == {"batch": [1, 4, 8], "seq": [32, 64]}
    assert parse_buckets("batch=1;seq=8") == {"batch": [1], "seq": [8]}
    assert parse_buckets({"batch": (4, 2)}) == {"batch": [2, 4]}
    for bad in ("batch", "batch=", "batch=1,x", "batch=0", "batch=1 batch=2"):
        with pytest.raises(KilnError, match="bucket"):
            parse_buckets(bad)


def test_unknown_bucket_dim_is_refused_naming_the_dims():
    with pytest.raises(KilnError, match="'height'.*batch"):
        kiln.Session("zoo:bert-tiny", buckets="height=1,2")


def test_metadata_for_the_server(bert):
    seq = bert.limits["seq"].limit  # the position table's length (test_session_limits.py)
    assert bert.inputs[0] == {
        "name": "input_ids", "datatype": "INT64", "shape": [-1, -1], "max_shape": [-1, seq]
    }  # fmt: skip
    assert bert.outputs[0] == {
        "name": "last_hidden_state",
        "datatype": "FP32",
        "shape": [-1, -1, 64],
    }
    assert bert.input_names == ["input_ids", "attention_mask", "token_type_ids"]


def test_routing_picks_the_smallest_bucket_and_padding_keeps_outputs(bert):
    ref = reference(bert)
    before = bert.stats()["buckets"]
    for (batch, seq), bucket in {
        (3, 10): "batch=4,seq=16",
        (1, 8): "batch=1,seq=8",
        (5, 17): "batch=8,seq=32",
        (2, 3): "batch=4,seq=8",
    }.items():
        feeds = bert_feeds(batch, seq, valid=seq - 1)
        assert_same(bert.run(None, feeds), ref.run(None, feeds))
        runs = bert.stats()["buckets"][bucket]["runs"]
        assert runs == before.get(bucket, {}).get("runs", 0) + 1, (batch, seq, bucket)
    assert bert.stats()["padding"] == {
        "batch": {"allowed": True, "reason": "rows independent"},
        "seq": {"allowed": True, "reason": "masked by attention_mask"},
    }


def test_shapes_outside_every_bucket_run_dynamic_and_count_as_misses(bert):
    feeds = bert_feeds(9, 40)
    misses = bert.stats()["misses"]
    assert_same(bert.run(["pooler_output"], feeds), reference(bert).run(["pooler_output"], feeds))
    stats = bert.stats()
    assert stats["misses"] == misses + 1
    assert stats["missed_shapes"]["batch=9,seq=40"] >= 1


def test_run_batch_equals_individual_runs(bert):
    requests = [bert_feeds(1, 5), bert_feeds(2, 16, valid=11), bert_feeds(1, 9), bert_feeds(3, 2)]
    batched = bert.run_batch(requests)
    ref = reference(bert)
    for feeds, outputs in zip(requests, batched, strict=True):
        assert_same(outputs, ref.run(None, feeds))
    # 7 rows, seq padded to 16, run together in the batch-8 bucket
    assert bert.stats()["buckets"]["batch=8,seq=16"]["requests"] >= 4
    only = bert.run_batch(requests[:2], ["pooler_output"])
    assert [len(o) for o in only] == [1, 1] and only[1][0].shape == (2, 64)


def test_stats_counts_misses_and_waste():
    with kiln.Session("zoo:bert-tiny", buckets="batch=2 seq=8") as session:
        session.run(None, bert_feeds(1, 8))  # padded to batch 2: half of it padding
        session.run(None, bert_feeds(2, 8))  # exact
        session.run(None, bert_feeds(3, 8))  # miss
        stats = session.stats()
    assert (stats["requests"], stats["hits"], stats["misses"]) == (3, 2, 1)
    assert stats["missed_shapes"] == {"batch=3,seq=8": 1}
    assert stats["buckets"]["batch=2,seq=8"]["runs"] == 2
    assert stats["buckets"]["batch=2,seq=8"]["padding_waste"] == pytest.approx(24 / 96)
    assert stats["buckets"]["dynamic"]["padding_waste"] == 0
    assert stats["padding_waste"] == pytest.approx(24 / (96 + 72))
    assert stats["buckets"]["dynamic"]["p50_ms"] > 0
    assert stats["compiles"] == 1


def batch_mixing_model(path) -> str:
    """y = x - mean(x over the batch): rows are NOT independent."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])
    nodes = [
        helper.make_node("ReduceMean", ["x"], ["m"], keepdims=1, axes=[0]),
        helper.make_node("Sub", ["x", "m"], ["y"]),
    ]
    graph = helper.make_graph(nodes, "mix", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path / "mix.onnx")
    return str(path / "mix.onnx")


def test_batch_padding_refused_when_rows_are_not_independent(tmp_path):
    with kiln.Session(batch_mixing_model(tmp_path), buckets="batch=4") as session:
        x3 = RNG.random((3, 4), dtype=np.float32)
        (y,) = session.run(None, {"x": x3})
        np.testing.assert_allclose(y, x3 - x3.mean(axis=0), atol=1e-6)
        x4 = RNG.random((4, 4), dtype=np.float32)
        np.testing.assert_allclose(session.run(None, {"x": x4})[0], x4 - x4.mean(0), atol=1e-6)
        # requests are not concatenated either: each one keeps its own mean
        outs = session.run_batch([{"x": x3}, {"x": x4}])
        np.testing.assert_allclose(outs[0][0], x3 - x3.mean(0), atol=1e-6)
        stats = session.stats()
    assert stats["padding"]["batch"]["allowed"] is False
    assert "not independent" in stats["padding"]["batch"]["reason"]
    assert stats["missed_shapes"] == {"batch=3": 2}  # batch 3 ran unpadded
    assert stats["buckets"]["batch=4"]["runs"] == 2  # batch 4 hit its exact bucket


def test_sequence_padding_needs_a_mask(tmp_path):
    """A sequence model without an attention mask never gets its sequence padded."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq"])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 1])
    node = helper.make_node("ReduceMean", ["x"], ["y"], keepdims=1, axes=[1])
    model = helper.make_model(
        helper.make_graph([node], "mean", [x], [y]), opset_imports=[helper.make_opsetid("", 17)]
    )
    model.ir_version = 8
    onnx.save(model, tmp_path / "mean.onnx")
    with kiln.Session(tmp_path / "mean.onnx", buckets="batch=2 seq=8") as session:
        x = RNG.random((2, 5), dtype=np.float32)
        np.testing.assert_allclose(
            session.run(None, {"x": x})[0], x.mean(1, keepdims=True), rtol=1e-6
        )
        stats = session.stats()
    assert stats["padding"]["seq"] == {
        "allowed": False,
        "reason": "no attention-mask input covers 'seq'",
    }
    assert stats["misses"] == 1


def test_warmup_compiles_every_bucket_ahead():
    with kiln.Session("zoo:resnet-tiny", buckets="batch=1,2,4", warmup=True) as session:
        assert session.stats()["compiles"] == 3
        x = RNG.random((3, 3, 32, 32), dtype=np.float32)
        want = reference(session).run(None, {"input": x})
        assert_same(session.run(None, {"input": x}), want)
        assert session.stats()["compiles"] == 3  # nothing compiled on the request path


def test_forced_swap_under_load_drops_nothing(bert):
    feeds = [bert_feeds(b, s) for b, s in ((1, 8), (3, 12), (8, 32), (2, 20))]
    expected = [bert.run(None, f) for f in feeds]
    errors: list[BaseException] = []
    stop = threading.Event()
    runs = [0] * 4
    progress = threading.Condition()  # notified after every round of every worker

    def hammer(worker: int) -> None:
        while not stop.is_set():
            try:
                for f, want in zip(feeds, expected, strict=True):
                    assert_same(bert.run(None, f), want)
            except BaseException as exc:  # noqa: BLE001 - every failure counts
                errors.append(exc)
                return
            finally:
                with progress:
                    runs[worker] += 1
                    progress.notify_all()

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    swaps = bert.stats()["swaps"]
    bert.swap(wait=True)  # the same set, rebuilt and swapped
    bert.swap("batch=2,8 seq=16,32", wait=True)
    with progress:  # every worker finishes a whole round on the new set (or fails)
        after = list(runs)
        progress.wait_for(lambda: all(r >= a + 2 for r, a in zip(runs, after, strict=True)), 120)
    stop.set()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert min(runs) > 0
    stats = bert.stats()
    assert stats["swaps"] == swaps + 2
    assert stats["bucket_set"] == {"batch": [2, 8], "seq": [16, 32]}
    assert [d["action"].startswith("swapped") for d in stats["decisions"][-2:]] == [True, True]


def test_adaptive_rebuilds_when_the_traffic_shifts():
    """Traffic moves from seq 32 to short sequences: padding waste crosses the threshold, the
    worker proposes buckets from the observed shapes, verifies and swaps them in."""
    session = kiln.Session("zoo:bert-tiny", buckets="batch=1 seq=32", adaptive=True)
    session.policy.min_samples, session.policy.interval_s = 20, 0.1
    try:
        for _ in range(20):
            session.run(None, bert_feeds(1, 32))
        # The worker's first judgement of a full window sees exactly these 20 runs.
        assert session.monitor.wait_until(lambda m: m.checks >= 1, timeout=60)
        stats = session.stats()
        assert stats["swaps"] == 0, stats["decisions"]  # no waste, no miss: nothing to do
        assert not [d for d in stats["decisions"] if d["trigger"].startswith("padding waste")]
        for _ in range(8):
            for seq in (4, 5, 6, 4, 5, 6, 8):
                session.run(None, bert_feeds(1, seq))
        assert session.wait_for_swap(1, timeout=60), session.stats()["decisions"]
        stats = session.stats()
        assert stats["swaps"] == 1, stats["decisions"]
        decision = stats["decisions"][-1]
        assert decision["trigger"].startswith("padding waste"), decision
        assert max(stats["bucket_set"]["seq"]) == 32 and min(stats["bucket_set"]["seq"]) <= 6
        feeds = bert_feeds(1, 5)
        assert_same(session.run(None, feeds), reference(session).run(None, feeds))
        assert session.stats()["padding_waste"] < stats["padding_waste"]
    finally:
        session.close()


def test_adaptive_adds_a_bucket_for_a_frequent_missed_shape(tmp_path):
    session = kiln.Session(batch_mixing_model(tmp_path), buckets="batch=1", adaptive=True)
    session.policy.min_samples, session.policy.interval_s = 20, 0.1
    try:
        for _ in range(10):
            for batch in (3, 3, 3, 1):
                session.run(None, {"x": RNG.random((batch, 4), dtype=np.float32)})
        assert session.wait_for_swap(1, timeout=60), session.stats()["decisions"]
        stats = session.stats()
        assert stats["swaps"] == 1, stats["decisions"]
        assert stats["decisions"][-1]["trigger"].startswith("frequent shape batch=3")
        assert 3 in stats["bucket_set"]["batch"]
    finally:
        session.close()


def test_openvino_artifact_uses_static_buckets(tmp_path):
    pytest.importorskip("openvino")
    artifact = kiln.compile("zoo:resnet-tiny", tmp_path / "ov.kiln", backend="openvino", rounds=0)
    with kiln.Session(artifact.path, buckets="batch=2,4") as session:
        x = RNG.random((3, 3, 32, 32), dtype=np.float32)
        want = ort.InferenceSession(
            str(artifact.model_path), providers=["CPUExecutionProvider"]
        ).run(None, {"input": x})
        got = session.run(None, {"input": x})
        np.testing.assert_allclose(got[0], want[0], atol=1e-4)
        runner = session._state.runners[(("batch", 4),)]
        shape = runner.compiled.inputs[0].get_partial_shape()
        assert shape.is_static and shape[0].get_length() == 4


def test_a_bucket_the_model_cannot_run_falls_back_to_dynamic():
    """bert-tiny has 64 positions: a seq-128 bucket fails; its requests still get answers."""
    with kiln.Session("zoo:bert-tiny", buckets="batch=1 seq=128") as session:
        feeds = bert_feeds(1, 40)
        for _ in range(2):
            assert_same(session.run(None, feeds), reference(session).run(None, feeds))
        stats = session.stats()
        with pytest.raises(KilnError, match="input_ids"):  # the user's errors stay theirs
            session.run(None, {**feeds, "input_ids": feeds["input_ids"].astype(np.int32)})
    failed = [d for d in stats["decisions"] if "failed" in d["trigger"]]
    assert len(failed) == 1 and failed[0]["action"] == "route to dynamic"
    assert stats["misses"] == 2


def test_bucket_executables_share_one_copy_of_the_weights():
    with kiln.Session("zoo:bert-tiny", buckets="batch=1,2", warmup=True) as session:
        first, second = session._state.runners.values()
        assert first.weights is not None and first.weights is second.weights
        assert len(first.weights.values) > 0
        assert session.executable.weights is None  # the dynamic one keeps its own settings


def test_bucket_proposals_and_scores():
    from kiln.runtime import buckets as bk

    seen = [{"seq": s} for s in (5, 5, 6, 6, 7, 8, 30, 31)]
    assert bk.route({"seq": 6}, {"seq": [8, 32]}, {"seq": True}) == (("seq", 8),)
    assert bk.route({"seq": 6}, {"seq": [8, 32]}, {"seq": False}) is None
    proposal = bk.propose(seen, ["seq"], {"seq": True}, per_dim=4)
    assert max(proposal["seq"]) == 31 and len(proposal["seq"]) <= 4
    coarse = {"seq": [32]}
    assert bk.score(seen, proposal, {"seq": True}) < bk.score(seen, coarse, {"seq": True})
    assert bk.propose(seen, ["seq"], {"seq": False}, per_dim=2)["seq"] == [5, 6]


def test_p99_drift_triggers_a_rebuild_decision():
    from kiln.runtime.adaptive import AdaptivePolicy, Trigger, TriggerKind, find_trigger
    from kiln.runtime.monitor import Observation

    policy, baseline = AdaptivePolicy(min_samples=10), {}
    fast = [Observation({"batch": 1, "seq": 16}, "batch=1,seq=16", 1e-3, 1, 1)] * 10
    assert find_trigger(fast, policy, baseline) is None  # sets the baseline
    slow = [Observation({"batch": 1, "seq": 16}, "batch=1,seq=16", 5e-3, 1, 1)] * 10
    drift = find_trigger(fast + slow, policy, baseline)
    assert drift.kind is TriggerKind.P99_DRIFT
    assert str(drift).startswith("P99 drift on batch=1,seq=16")
    missed = [Observation({"batch": 3}, "dynamic", 1e-3, 1, 1)] * 2
    miss = find_trigger(fast + missed, policy, baseline)
    assert miss.kind is TriggerKind.MISSES and str(miss).startswith("frequent shape batch=3")
    wasteful = [Observation({"batch": 1}, "batch=4", 1e-3, 1, 4)] * 10
    assert find_trigger(wasteful, policy, {}) == Trigger(
        TriggerKind.WASTE, "padding waste 75% > 35%"
    )


def test_the_next_session_starts_from_what_this_one_learnt(tmp_path):
    path = batch_mixing_model(tmp_path)
    with kiln.Session(path, buckets="batch=1") as first:
        first.run(None, {"x": RNG.random((1, 4), dtype=np.float32)})
        first.swap("batch=2,3", wait=True)
    with kiln.Session(path, adaptive=True) as second:
        assert second.buckets == {"batch": [2, 3]}  # an adaptive session resumes the last set
        second.run(None, {"x": RNG.random((2, 4), dtype=np.float32)})
        stats = second.stats()
    assert stats["padding"]["batch"]["allowed"] is False  # recorded, not checked again
    assert not [d for d in stats["decisions"] if d["trigger"].startswith("padding check")]
    with kiln.Session(path) as plain:
        assert plain.buckets == {}  # without adaptive, only the buckets asked for


def test_least_recently_used_executables_are_dropped_beyond_the_cap():
    with kiln.Session("zoo:resnet-tiny", buckets="batch=1,2,4") as session:
        session.max_executables = 2
        ref = reference(session)
        for batch in (1, 2, 4, 1):
            x = RNG.random((batch, 3, 32, 32), dtype=np.float32)
            assert_same(session.run(None, {"input": x}), ref.run(None, {"input": x}))
        stats = session.stats()
    assert (stats["compiles"], stats["evictions"], stats["executables_loaded"]) == (4, 2, 2)


def test_bad_options_and_corrupt_records_name_the_problem(tmp_path, kiln_home):
    with pytest.raises(KilnError, match="unknown option.*'threads'.*intra_op_threads"):
        kiln.Session("zoo:bert-tiny", options={"threads": 2})
    with pytest.raises(KilnError, match="unknown backend 'tpu'"):
        kiln.Session("zoo:bert-tiny", backend="tpu")
    path = batch_mixing_model(tmp_path)
    kiln.Session(path, buckets="batch=1").run(None, {"x": np.ones((1, 4), np.float32)})
    records = list((kiln_home / "runtime").glob("*.json"))
    assert len(records) == 1
    for record in records:
        record.write_text('{"padding": [1], "buckets": {"nope": [1]}}')
    with kiln.Session(path, adaptive=True, buckets=None) as session:
        assert session.buckets == {}
        assert session.verdict("batch").allowed is False


def test_swap_after_close_is_refused():
    session = kiln.Session("zoo:resnet-tiny", buckets="batch=1")
    session.close()
    session.close()  # twice is fine
    with pytest.raises(KilnError, match="closed"):
        session.swap(wait=True)


def test_int8_artifacts_pad_within_int8_noise(tmp_path):
    """Dynamic int8 quantises with one scale per tensor, so co-batched rows nudge each other
    within int8 noise: padding is judged at that precision's tolerance, not fp32's."""
    from kiln.runtime.padding import close

    artifact = kiln.compile("zoo:bert-tiny", tmp_path / "int8.kiln", precision="int8")
    with kiln.Session(artifact.path, buckets="batch=4 seq=32") as session:
        assert session.precision == "int8"
        feeds = bert_feeds(3, 20)
        got, want = session.run(None, feeds), session.executable.run(feeds)
        assert all(close(w, g, "int8") for w, g in zip(want, got, strict=True))
        assert session.stats()["hits"] == 1
        assert session.verdict("batch").allowed and session.verdict("seq").allowed
    # A model mixing rows still fails at int8 tolerance: x - mean(x over the batch), with
    # one more (padding) row in the mean.
    x = RNG.random((3, 4), dtype=np.float32)
    padded = np.concatenate([x, RNG.random((1, 4), dtype=np.float32)])
    assert not close(x - x.mean(0), x - padded.mean(0), "int8")
    assert close(x, x * (1 + 1e-6), "int8") and not close(x, x + 1e-3, "fp32")
