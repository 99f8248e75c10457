"""Folding the glue's Kiln ops into a stage's graph: the chains recorded around a model's calls
are prepended and appended, the folded model equals the eager ops and the model, a fold that
is not faster is not kept and says why, and a pipeline artifact with a fold kept gives the
plain function's results, one input at a time and on many streams."""

from __future__ import annotations

import json
import os
import textwrap
import threading
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.pipeline import compile_pipeline, fold, load_function, ops, record
from kiln.pipeline.fold import FOLDED_FILE, Fold, FoldedModel, build_folded, find_fold
from kiln.timing import FASTER, SLOWER, Speedup

pytestmark = pytest.mark.timeout(300)
CLASSES, DEPTH = 97, 8

GLUE = '''
import numpy as np
from kiln.pipeline import ops

def read(image, *, rec):
    """uint8 [N, T, 8] → normalised floats → logits [N, T, 97] → CTC labels."""
    x = ops.normalize(image, 127.5, 63.5, scale=1.0)
    (logits,) = rec.run(None, {"x": x})
    return ops.ctc_greedy_decode(logits, blank=0).tolist()

def read_scored(image, *, rec):
    """As `read`, with the best logit read from the model's output by plain numpy."""
    (logits,) = rec.run(None, {"x": ops.normalize(image, 127.5, 63.5, scale=1.0)})
    return ops.ctc_greedy_decode(logits, blank=0).tolist(), float(np.max(logits))

def inputs():
    rng = np.random.default_rng(3)
    return [rng.integers(0, 256, (1 + i % 3, 12, 8), dtype=np.uint8) for i in range(6)]
'''


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fold")
    (root / "glue.py").write_text(textwrap.dedent(GLUE))
    weight = np.random.default_rng(0).standard_normal((DEPTH, CLASSES)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "rec",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", "t", DEPTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", "t", CLASSES])],
        [numpy_helper.from_array(weight, "w")],
    )  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
              root / "rec.onnx")  # fmt: skip
    read = load_function(f"{root / 'glue.py'}:read")
    data = load_function(f"{root / 'glue.py'}:inputs")()
    with kiln.Session(str(root / "rec.onnx")) as rec:
        recording = record(read, {"rec": rec}, data)
    return {"root": root, "read": read, "data": data, "recording": recording}


def test_the_recorded_chains_are_found_and_the_folded_model_equals_the_eager_ops(case) -> None:
    calls = case["recording"].of("rec")
    found = find_fold(calls)
    assert found.pre == {"x": (("normalize", (((), (127.5,)), ((), (63.5,)), 1.0)),)}
    assert found.post == {"y": (("ctc_greedy_decode", (0,)),)}
    folded = build_folded(onnx.load(case["root"] / "rec.onnx"), found, {"x": calls[0].pre["x"][0]})
    session = ort.InferenceSession(folded.SerializeToString(), providers=["CPUExecutionProvider"])
    with kiln.Session(str(case["root"] / "rec.onnx")) as rec:
        for call in calls:
            image = call.pre["x"][0]
            assert image.dtype == np.uint8
            (logits,) = rec.run(None, {"x": ops.apply_steps(image, found.pre["x"])})
            expected = ops.apply_steps(logits, found.post["y"])
            (labels,) = session.run(None, {"x": image})
            assert labels.dtype == np.int64 and labels.shape == call.outputs[0].shape[:2]
            np.testing.assert_array_equal(labels, expected)


def test_a_model_below_the_folds_opset_is_converted_and_still_equals_the_eager_ops(case) -> None:
    calls = case["recording"].of("rec")
    found = find_fold(calls)
    old = onnx.load(case["root"] / "rec.onnx")
    del old.opset_import[:]
    old.opset_import.append(helper.make_opsetid("", 12))  # PP-OCRv4's detector's opset
    folded = build_folded(old, found, {"x": calls[0].pre["x"][0]})
    assert [(o.domain, o.version) for o in folded.opset_import] == [("", 13)]
    session = ort.InferenceSession(folded.SerializeToString(), providers=["CPUExecutionProvider"])
    with kiln.Session(str(case["root"] / "rec.onnx")) as rec:
        for call in calls:
            image = call.pre["x"][0]
            (logits,) = rec.run(None, {"x": ops.apply_steps(image, found.pre["x"])})
            (labels,) = session.run(None, {"x": image})
            np.testing.assert_array_equal(labels, ops.apply_steps(logits, found.post["y"]))


def _stages(root: Path, tmp: Path) -> dict:
    """A compiled stage as compile.py hands it over: its chosen artifact."""
    artifact = tmp / "rec.kiln"
    if not artifact.exists():
        kiln.compile(str(root / "rec.onnx"), artifact, force=True,
                     inputs={"x": np.zeros((1, 12, DEPTH), np.float32)})  # fmt: skip

    class Stage:
        candidates, choice = {"fp32": artifact}, "fp32"

    return {"rec": Stage()}


def test_a_fold_that_is_not_faster_is_not_kept_and_says_so(case, tmp_path) -> None:
    stages = _stages(case["root"], tmp_path)
    said: list[str] = []

    def slower(eager, folded) -> Speedup:
        eager(), folded()  # both paths run
        return Speedup(0.8, (0.7, 0.9), SLOWER)

    folds = fold.fold_stages(case["read"], stages, case["data"], case["recording"],
                             _exact, said.append, measure=slower)  # fmt: skip
    record_ = folds["rec"]
    assert not record_["kept"] and record_["verdict"] == SLOWER and record_["calls"] == 6
    assert record_["reason"] == "not faster than the eager ops (0.80x, slower)"
    assert not (tmp_path / "rec.kiln" / FOLDED_FILE).exists()
    assert said == ["  rec: checking and timing its Kiln ops folded in, on 6 calls ...",
                    "  rec: not folded: not faster than the eager ops (0.80x, slower)"]  # fmt: skip


def test_a_slow_stages_fold_is_timed_on_few_calls_and_a_quick_ones_on_eight(case) -> None:
    calls = case["recording"].of("rec")
    heavy = [type(c)(c.model, c.query, c.feeds, c.outputs, 0.4) for c in calls * 4]
    light = [type(c)(c.model, c.query, c.feeds, c.outputs, 0.001) for c in calls * 4]
    assert len(fold._sample(heavy)) == 1  # a detector's half-second calls: one per timed run
    assert len(fold._sample(light)) == 8


def test_a_fold_for_many_streams_is_timed_with_that_many_calls_at_once(case, tmp_path, monkeypatch):
    threads: list[str] = []
    real = ops.apply_steps

    def spy(x, steps):
        threads.append(threading.current_thread().name)
        return real(x, steps)

    def measure(eager, folded) -> Speedup:
        threads.clear()
        eager()  # one timed run of the eager path
        return Speedup(0.8, (0.7, 0.9), SLOWER)

    monkeypatch.setattr(ops, "apply_steps", spy)
    stages, recording = _stages(case["root"], tmp_path), case["recording"]
    seen = {}
    for streams in (1, 4):
        fold.fold_stages(case["read"], stages, case["data"], recording, _exact, lambda _: None,
                         measure=measure, streams=streams)  # fmt: skip
        seen[streams] = list(threads)
    at_once = min(4, os.cpu_count() or 1)  # as many streams as the cores can run at once
    assert len(set(seen[4])) == at_once and len(seen[4]) == at_once * len(seen[1])


def test_a_feed_that_only_starts_a_chain_has_nothing_to_fold(case) -> None:
    (call, *_) = case["recording"].of("rec")
    root = type(call)(call.model, call.query, call.feeds, call.outputs, call.seconds,
                      pre={"x": (call.feeds["x"], ())})  # the glue ran ops on it, not to it
    assert find_fold([root]) == Fold()


def test_a_stage_without_kiln_ops_around_it_is_not_folded(case, tmp_path) -> None:
    calls = case["recording"].of("rec")
    for call in calls:
        call_ = type(call)(call.model, call.query, call.feeds, call.outputs, call.seconds)
        assert find_fold([call_]) == Fold()
    recording = type(case["recording"])([type(c)(c.model, c.query, c.feeds, c.outputs, c.seconds)
                                         for c in calls])  # fmt: skip
    folds = fold.fold_stages(case["read"], _stages(case["root"], tmp_path), case["data"],
                             recording, _exact, lambda _: None)  # fmt: skip
    assert folds["rec"]["reason"] == "no chain of Kiln ops made its feeds or took its outputs"


def _exact(references: list, outputs: list) -> float:
    return float(np.mean([r == o for r, o in zip(references, outputs, strict=True)]))


@pytest.fixture(scope="module")
def compiled(case, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("folded") / "read.kiln"
    faster = lambda eager, folded: Speedup(1.5, (1.2, 1.8), FASTER)  # noqa: E731
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(fold, "measure_fold", faster)  # the machine's timing is not under test
        models = {"rec": str(case["root"] / "rec.onnx")}
        compile_pipeline(f"{case['root'] / 'glue.py'}:read", models, case["data"], out,
                         precisions=())  # fmt: skip
    return out


def test_a_pipeline_with_its_fold_kept_gives_the_plain_functions_results(case, compiled) -> None:
    manifest = json.loads((compiled / "pipeline.json").read_text())
    assert manifest["folds"]["rec"]["kept"], manifest["folds"]
    assert manifest["folds"]["rec"]["post"] == {"y": [["ctc_greedy_decode", [0]]]}
    assert (compiled / "stages/rec.kiln" / FOLDED_FILE).is_file()
    with kiln.Session(str(case["root"] / "rec.onnx")) as rec:
        plain = [case["read"](x, rec=rec) for x in case["data"]]
    with kiln.Pipeline(str(compiled)) as pipe:
        assert isinstance(pipe.sessions["rec"], FoldedModel)
        assert [pipe(x) for x in case["data"]] == plain
        assert pipe.map(case["data"], streams=3) == plain


def test_a_call_off_the_recorded_chain_runs_the_stage_as_it_is(case, compiled) -> None:
    with kiln.Pipeline(str(compiled)) as pipe:
        rec = pipe.sessions["rec"]
        image = case["data"][0]
        plain = ops.apply_steps(image, rec.fold.pre["x"])  # the same values, no chain remembered
        (logits,) = rec.run(None, {"x": plain})
        assert logits.shape == (1, 12, CLASSES)  # the stage's own output, not the labels
        other = ops.normalize(image, 127.5, 63.5, scale=2.0)  # another chain
        assert rec.run(None, {"x": other})[0].shape == (1, 12, CLASSES)
        (stand_in,) = rec.run(None, {"x": ops.normalize(image, 127.5, 63.5, scale=1.0)})
        assert stand_in.shape == (0,), "the folded path hands back a stand-in"
        # The folded path: an op other than the recorded one recovers the real output.
        np.testing.assert_array_equal(ops.argmax(stand_in, axis=-1), logits.argmax(-1))


def test_a_fold_whose_output_the_glue_reads_beyond_the_ops_is_dropped(case, tmp_path) -> None:
    scored = load_function(f"{case['root'] / 'glue.py'}:read_scored")
    with kiln.Session(str(case["root"] / "rec.onnx")) as rec:
        recording = record(scored, {"rec": rec}, case["data"])
    faster = lambda eager, folded: Speedup(1.5, (1.2, 1.8), FASTER)  # noqa: E731
    folds = fold.fold_stages(scored, _stages(case["root"], tmp_path), case["data"], recording,
                             _exact, lambda _: None, measure=faster)  # fmt: skip
    assert not folds["rec"]["kept"]
    assert "the glue reads the output beyond the ops" in folds["rec"]["reason"]
    assert not (tmp_path / "rec.kiln" / FOLDED_FILE).exists()
