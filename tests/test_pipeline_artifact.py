"""A pipeline artifact runs only as it was compiled: a function module edited since is refused
with the reason; a path that is not there is named as missing, not as a wrong kind of thing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx
import pytest
from cli_helpers import kiln_cli
from onnx import TensorProto, helper

from kiln.errors import KilnError
from kiln.pipeline import Pipeline, compile_pipeline
from kiln.pipeline.data import load_data

pytestmark = pytest.mark.timeout(300)

GLUE = """import numpy as np

def double_all(value, *, det):
    (y,) = det.run(None, {"x": np.full((1, 4), value, np.float32)})
    return float(y.sum())

def inputs():
    return [1.0, 2.0, 3.0]
"""


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("artifact")
    (root / "flow.py").write_text(GLUE)
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["y"])], "double",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor("two", TensorProto.FLOAT, [], [2.0])],
    )  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
              root / "d.onnx")  # fmt: skip
    return compile_pipeline(f"{root}/flow.py:double_all", {"det": str(root / "d.onnx")},
                            f"{root}/flow.py:inputs", root / "flow.kiln")  # fmt: skip


def test_a_function_module_edited_after_the_compile_is_refused(artifact, tmp_path, monkeypatch,
                                                               capsys) -> None:  # fmt: skip
    with Pipeline(str(artifact)) as pipe:
        assert pipe(1.0) == 8.0
    edited = tmp_path / "edited.kiln"
    shutil.copytree(artifact, edited)
    module = edited / "flow.py"
    module.write_text(module.read_text().replace("float(y.sum())", "'changed'"))
    with pytest.raises(KilnError, match="flow.py changed after the compile"):
        Pipeline(str(edited))
    data = f"{artifact.parent}/flow.py:inputs"
    code, _, err = kiln_cli(monkeypatch, capsys, "run", str(edited), "--data", data,
                            "-o", str(tmp_path / "out.jsonl"))  # fmt: skip
    assert code == 2 and "changed after the compile" in err
    assert not (tmp_path / "out.jsonl").exists()


def test_a_path_that_is_not_there_is_named_missing(tmp_path, monkeypatch, capsys) -> None:
    missing = str(tmp_path / "nothere.kiln")
    with pytest.raises(KilnError, match="nothere.kiln: no pipeline artifact there"):
        Pipeline(missing)
    with pytest.raises(KilnError, match="--data nodir: no such directory"):
        load_data("nodir")
    for verb in ("run", "profile", "compare", "bench"):
        args = [verb, missing, "--data", "x.py:inputs"]
        code, _, err = kiln_cli(monkeypatch, capsys, *args, "-o", str(tmp_path / "o.jsonl")) \
            if verb == "run" else kiln_cli(monkeypatch, capsys, *args)  # fmt: skip
        assert code == 2 and "nothere.kiln: no such file" in err, (verb, err)


def test_kiln_run_of_a_pipeline_writes_json_lines_only(artifact, tmp_path, monkeypatch, capsys):
    data = f"{artifact.parent}/flow.py:inputs"
    code, _, err = kiln_cli(monkeypatch, capsys, "run", str(artifact), "--data", data,
                            "-o", str(tmp_path / "out.npz"))  # fmt: skip
    assert code == 2 and "a pipeline's results are JSON lines" in err
    assert not (tmp_path / "out.npz").exists()


def test_a_manifest_missing_a_stage_is_named_damaged(artifact, tmp_path) -> None:
    damaged = tmp_path / "damaged.kiln"
    shutil.copytree(artifact, damaged)
    manifest = json.loads((damaged / "pipeline.json").read_text())
    del manifest["stages"]["det"]
    (damaged / "pipeline.json").write_text(json.dumps(manifest))
    with pytest.raises(KilnError, match="are not the models double_all takes: the artifact is"):
        Pipeline(str(damaged))


def test_a_stage_model_changed_after_the_compile_is_refused(artifact, tmp_path) -> None:
    altered = tmp_path / "altered.kiln"
    shutil.copytree(artifact, altered)
    model_file = altered / "stages" / "det.kiln" / "model.onnx"
    model = onnx.load(model_file)
    for weight in model.graph.initializer:  # still a valid model, other weights
        weight.CopyFrom(helper.make_tensor(weight.name, weight.data_type, weight.dims,
                                           [3.0] * max(1, len(weight.float_data or [0]))))
    onnx.save(model, model_file)
    with pytest.raises(KilnError, match="det.kiln changed after the compile"):
        Pipeline(str(altered))
