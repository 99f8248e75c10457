"""A stage's calls from several streams share a run only where a batch measured faster per
sample: a stage whose batch is no faster runs every call apart and still gives the plain
function's results; a model that takes no batch of two is never merged; the decision travels
in the artifact and the runtime follows it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from kiln.pipeline import Pipeline, compile_pipeline, merging, record, run_streams
from kiln.runtime import Session
from kiln.timing import FASTER, SAME, Speedup

pytestmark = pytest.mark.timeout(300)


def _double(path: Path, batch: int | str = "batch") -> Path:
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["y"])], "double",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 4])],
        [helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])],
    )  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def double_all(value: float, *, det) -> float:
    (y,) = det.run(None, {"x": np.full((1, 4), value, np.float32)})
    return float(y.sum())


INPUTS = [float(i) for i in range(24)]


def _decide(model: Path, verdict: str) -> dict:
    with Session(str(model)) as det:
        reference = record(double_all, {"det": det}, INPUTS)
    stages = {"det": SimpleNamespace(candidates={"fp32": model}, choice="fp32")}
    said: list[str] = []

    def measure(apart, merged) -> Speedup:
        apart(), merged()  # both paths run on the stage's artifact
        return Speedup(1.6 if verdict == FASTER else 1.02, (1.0, 1.9), verdict)

    decided = merging.decide_merging(stages, reference, said.append, measure=measure)["det"]
    assert said[0] == "  det: timing a batch of two of its calls against the two apart ..."
    return decided


def test_a_stage_whose_batch_is_no_faster_runs_apart_and_one_that_is_faster_merges(tmp_path):
    model = _double(tmp_path / "det.onnx")
    same = _decide(model, SAME)
    assert not same["merge"]
    assert same["reason"] == (
        "a batch of two is not faster per sample (1.02x, no different within noise)"
    )
    faster = _decide(model, FASTER)
    assert faster["merge"] and faster["reason"] == "a batch of two is 1.60x faster per sample"


def test_a_model_that_takes_no_batch_of_two_is_never_merged(tmp_path) -> None:
    decided = _decide(_double(tmp_path / "fixed.onnx", batch=1), FASTER)
    assert not decided["merge"] and "takes no batch of two" in decided["reason"]


def test_calls_of_a_stage_run_apart_are_never_batched_and_give_the_plain_results(tmp_path):
    model = _double(tmp_path / "det.onnx")
    with Session(str(model)) as det:
        plain = [double_all(v, det=det) for v in INPUTS]
        run = run_streams(double_all, {"det": det}, INPUTS, streams=8, apart={"det"})
    assert run.results == plain
    assert run.stages["det"]["executions"] == run.stages["det"]["calls"] == len(INPUTS)


def test_the_decision_travels_in_the_artifact_and_the_runtime_follows_it(tmp_path) -> None:
    module = tmp_path / "flow.py"
    module.write_text(
        "import numpy as np\n\n"
        "def double_all(value, *, det):\n"
        "    (y,) = det.run(None, {'x': np.full((1, 4), value, np.float32)})\n"
        "    return float(y.sum())\n"
    )
    no_faster = lambda apart, merged: Speedup(1.0, (0.9, 1.1), SAME)  # noqa: E731
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(merging, "measure_merging", no_faster)  # timing is not under test here
        out = compile_pipeline(f"{module}:double_all", {"det": str(_double(tmp_path / "d.onnx"))},
                               INPUTS, tmp_path / "flow.kiln")  # fmt: skip
    manifest = json.loads((out / "pipeline.json").read_text())
    assert manifest["merging"]["det"]["merge"] is False
    with Pipeline(str(out)) as pipe:
        assert pipe.apart == {"det"}
        assert pipe.map(INPUTS, streams=8) == [8.0 * v for v in INPUTS]
        assert pipe.last_run.stages["det"]["executions"] == len(INPUTS)
