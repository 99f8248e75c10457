"""A pipeline is the user's own function over named models: recorded call by call, and run on
many streams with each model's calls pooled across them — loops, conditionals and early exits
included — giving the plain function's results."""

from __future__ import annotations

import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import kiln.pipeline as kp
from kiln.errors import KilnError
from kiln.pipeline import Pipeline, record
from kiln.runtime import Session

pytestmark = pytest.mark.timeout(120)


def _model(path: Path, op: str, width: int | str = "width") -> Path:
    """[batch, width] floats → `op`: "double" (y = 2x), or "score" (y = sum over width)."""
    if op == "double":
        nodes = [helper.make_node("Mul", ["x", "two"], ["y"])]
        out = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", width])
        inits = [helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])]
    else:
        nodes = [helper.make_node("ReduceSum", ["x", "axes"], ["y"], keepdims=0)]
        out = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch"])
        inits = [helper.make_tensor("axes", TensorProto.INT64, [1], [1])]
    graph = helper.make_graph(
        nodes, op, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", width])],
        [out], inits,
    )  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.fixture
def models(tmp_path: Path) -> dict[str, Path]:
    return {"det": _model(tmp_path / "det.onnx", "double"),
            "rec": _model(tmp_path / "rec.onnx", "score")}  # fmt: skip


def read(value: int, *, det, rec):
    """A detector, then a variable number of recogniser calls (one per 'crop', widths by the
    input), a conditional stage and an early exit."""
    if value < 0:
        return None  # early exit: no model runs
    row = np.full((1, 4 + value % 3), float(value), np.float32)
    (doubled,) = det.run(None, {"x": row})
    scores = []
    for width in range(1, 1 + value % 4):  # 0..3 calls
        (score,) = rec.run(["y"], {"x": doubled[:, :width].copy()})
        scores.append(float(score[0]))
    if value % 2:  # a second detector pass only for odd inputs
        (again,) = det.run(None, {"x": doubled})
        scores.append(float(again.sum()))
    return scores


INPUTS = [3, -1, 0, 5, 2, 7, 1, -4, 6, 4, 9, 8]


def test_many_streams_give_the_plain_functions_results_and_pool_calls(models) -> None:
    plain_sessions = {name: Session(str(path)) for name, path in models.items()}
    expected = [read(value, **plain_sessions) for value in INPUTS]
    with Pipeline(read, models) as pipe:
        assert pipe(5) == expected[3]
        assert pipe.map(INPUTS, streams=4) == expected
        stages = pipe.last_run.stages
    det_calls = sum(1 + v % 2 for v in INPUTS if v >= 0)
    rec_calls = sum(v % 4 for v in INPUTS if v >= 0)
    assert stages["det"]["calls"] == det_calls and stages["rec"]["calls"] == rec_calls
    assert stages["det"]["executions"] <= det_calls


def test_the_recording_keeps_each_calls_feeds_shapes_and_times(models) -> None:
    sessions = {name: Session(str(path)) for name, path in models.items()}
    recording = record(read, sessions, [5, -1, 3])
    assert recording.results == [read(v, **sessions) for v in [5, -1, 3]]
    rec = recording.of("rec")
    assert [call.query for call in rec] == [0, 2, 2, 2]  # input 5: 1 crop; input 3: 3 crops
    assert [call.feeds["x"].shape for call in rec] == [(1, 1), (1, 1), (1, 2), (1, 3)]
    np.testing.assert_array_equal(recording.feeds("det")[0]["x"], np.full((1, 6), 5.0))
    assert recording.shapes("det")["x"] == {(1, 6): 2, (1, 4): 2}  # odd inputs: det twice
    assert all(call.seconds > 0 for call in recording.calls)
    assert recording.glue_seconds() >= 0
    assert set(recording.model_seconds()) == {"det", "rec"}


def test_a_failing_model_names_the_model_and_the_input(models) -> None:
    def bad(value, *, det, rec):
        return det.run(None, {"x": np.zeros((1, 4), np.float64)})  # wrong dtype

    with Pipeline(bad, models) as pipe:
        with pytest.raises(
            KilnError,
            match=r"model 'det' failed on input 0 \(7\): .*det.onnx: input 'x' has dtype float64",
        ):
            pipe(7)
        with pytest.raises(KilnError, match=r"model 'det' failed on input \d"):
            pipe.map([1, 1, 1], streams=2)


def test_the_functions_own_bug_names_its_file_and_line(models) -> None:
    def buggy(value, *, det, rec):
        return 1 / value

    where = r"failed on input 1: ZeroDivisionError.*test_pipeline_runtime.py:\d+"
    with pytest.raises(KilnError, match=where):
        record(buggy, {name: Session(str(p)) for name, p in models.items()}, [1, 0])


def test_an_empty_data_set_is_refused(models) -> None:
    with pytest.raises(KilnError, match="empty"):
        record(read, {name: Session(str(p)) for name, p in models.items()}, [])


def test_the_function_is_found_by_module_and_name(tmp_path, models) -> None:
    source = tmp_path / "mypipe.py"
    source.write_text(
        textwrap.dedent("""
        def run(x, *, det, rec):
            return x
    """)
    )
    assert kp.load_function(f"{source}:run")(3, det=None, rec=None) == 3
    with pytest.raises(KilnError, match="has no function 'nope'.*its functions: run"):
        kp.load_function(f"{source}:nope")
    with pytest.raises(KilnError, match="MODULE:FUNCTION"):
        kp.load_function(str(source))
    with pytest.raises(KilnError, match="no module 'no_such_pipeline_module'"):
        kp.load_function("no_such_pipeline_module:run")
    broken = tmp_path / "broken.py"
    broken.write_text("x = 1\nraise RuntimeError('bad import')\n")
    with pytest.raises(KilnError, match=r"RuntimeError: bad import \(at .*broken.py:2\)"):
        kp.load_function(f"{broken}:run")


def test_the_models_given_must_be_the_ones_the_function_takes(models) -> None:
    with pytest.raises(KilnError, match="gives none for rec"):
        kp.check_models(read, ["det"])
    with pytest.raises(KilnError, match="takes no model named cls"):
        kp.check_models(read, ["det", "rec", "cls"])
    with pytest.raises(KilnError, match="positional"):
        kp.check_models(lambda *, det: None, ["det"])
    with pytest.raises(KilnError, match="given twice"):
        kp.parse_models(["det=a.onnx", "det=b.onnx"])
    with pytest.raises(KilnError, match="NAME=PATH"):
        kp.parse_models(["det"])
    assert kp.parse_models(["det=a.onnx", "rec=b.onnx"]) == {"det": "a.onnx", "rec": "b.onnx"}


def test_a_stage_batch_holds_only_calls_that_merge_and_the_others_wait_for_their_own_run():
    # Calls of other shapes must not ride along in one batch: one worker would run them one
    # after another and hold every answer until the last (a detector's images of other sizes).
    import threading

    from kiln.pipeline.streams import merge_group
    from kiln.runtime.batcher import Batcher

    gate, batches = threading.Event(), []

    def run_batch(requests):
        batches.append([r["x"].shape for r in requests])
        gate.wait(timeout=30)
        return [[r["x"]] for r in requests]

    batcher = Batcher(run_batch, max_delay=0.0, group=merge_group)
    batcher.start()
    first = batcher.submit({"x": np.zeros((1, 3, 8, 8), np.float32)})
    while not batches:  # the worker holds the first call: the rest queue behind it
        threading.Event().wait(0.001)
    wide, tall, wide2 = (
        batcher.submit({"x": np.zeros((1, 3, 8, w), np.float32)}) for w in (16, 32, 16)
    )
    gate.set()
    for future in (first, wide, tall, wide2):
        future.result(timeout=30)
    batcher.close()
    assert batches == [[(1, 3, 8, 8)], [(1, 3, 8, 16), (1, 3, 8, 16)], [(1, 3, 8, 32)]]
