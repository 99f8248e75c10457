"""`kiln.compile_pipeline`: each stage compiled and calibrated on what it really received, a
lossy choice kept only while the pipeline's final results hold, the artifact run as the plain
function runs; and bad input refused in one line with nothing written."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
from cli_helpers import kiln_cli
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.errors import KilnError
from kiln.pipeline import Pipeline, compile_pipeline, load_function
from kiln.pipeline import compile as pipeline_compile
from kiln.timing import FASTER, SAME, SLOWER, Speedup

pytestmark = pytest.mark.timeout(300)
WIDTH = 64
RNG = np.random.default_rng(0)

GLUE = '''
import numpy as np

def describe(x, *, embed, cls):
    """A label from `cls` (well-separated logits: int8 keeps the argmax) and the embedding's
    values to five decimals (int8 changes them)."""
    (logits,) = cls.run(None, {"x": x})
    (y,) = embed.run(None, {"x": x})
    return {"label": int(logits.argmax()), "embedding": np.round(y, 5).tolist()}

def labels(references, outputs):
    return float(np.mean([r["label"] == o["label"] for r, o in zip(references, outputs)]))

def inputs():
    rng = np.random.default_rng(1)
    for i in range(12):
        x = rng.standard_normal((1, 64)).astype(np.float32)
        x[0, i % 4] += 12.0
        yield x

def inputs_peer(x):
    return {"label": -1}

def not_a_number(references, outputs):
    return "high"

def flaky(x, *, embed, cls):
    return float(np.random.default_rng().random())
'''


def _matmul(path: Path, weight: np.ndarray) -> Path:
    """y = x @ weight on [batch, 64] floats."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], path.stem,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", weight.shape[1]])],
        [numpy_helper.from_array(weight, "w")],
    )  # fmt: skip
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.fixture(scope="module", autouse=True)
def lossy_pays():
    """The search's speed rule held fixed: these tests are about the metric's rule, on models
    too small for int8 to pay. The speed rule has its own test below."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(
            pipeline_compile, "stage_speedup", lambda *_: Speedup(1.5, (1.2, 1.8), FASTER)
        )
        yield


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("pipeline")
    (root / "glue.py").write_text(textwrap.dedent(GLUE))
    identity = np.zeros((WIDTH, 4), np.float32)
    identity[:4, :4] = np.eye(4)
    noise = 0.01 * RNG.standard_normal((WIDTH, 4)).astype(np.float32)
    models = {
        "embed": str(_matmul(root / "embed.onnx", RNG.standard_normal((WIDTH, WIDTH), np.float32))),
        "cls": str(_matmul(root / "cls.onnx", identity + noise)),
    }
    return {"root": root, "spec": f"{root / 'glue.py'}:describe", "models": models,
            "data": f"{root / 'glue.py'}:inputs"}  # fmt: skip


@pytest.fixture(scope="module")
def compiled(case) -> Path:
    out = case["root"] / "describe.kiln"
    compile_pipeline(
        case["spec"], case["models"], case["data"], out, max_drop=0.0, precisions=("int8",)
    )
    return out


def test_a_lossy_stage_that_breaks_the_final_result_is_rejected_though_it_passes_its_own_check(
    compiled,
) -> None:
    manifest = json.loads((compiled / "pipeline.json").read_text())
    space = manifest["search"]["space"]
    # Both int8 candidates passed their own model's check (they were compiled, verified) ...
    assert space["embed"]["candidates"] == ["fp32", "int8"]
    assert space["cls"]["candidates"] == ["fp32", "int8"]
    trials = {t["stage"]: t for t in manifest["search"]["trials"]}
    # ... but the embedding's int8 changes the pipeline's results: rejected, with the figures.
    embed = trials["embed"]
    assert not embed["kept"] and embed["metric"] < 1.0 and embed["drop"] > 0
    assert "the metric fell" in embed["reason"]
    assert manifest["stages"]["embed"]["precision"] == "fp32"
    # The classifier's int8 keeps every label and the embedding: kept.
    assert trials["cls"]["kept"] and trials["cls"]["metric"] == 1.0
    assert manifest["stages"]["cls"]["precision"] == "int8"
    assert manifest["metric"] == {"name": "exact", "reference": 1.0, "final": 1.0, "max_drop": 0.0}


def test_the_stage_is_calibrated_and_bucketed_on_what_it_received(case, compiled) -> None:
    manifest = json.loads((compiled / "pipeline.json").read_text())
    reference = manifest["reference"]
    assert reference["inputs"] == 12 and reference["calls"] == {"embed": 12, "cls": 12}
    assert reference["shapes"]["cls"]["x"] == {f"1x{WIDTH}": 12}
    stage = json.loads((compiled / "stages/cls.kiln/manifest.json").read_text())
    calib = json.dumps(stage)
    assert "12 samples" in calib or "12 sample" in calib, "calibrated on the 12 recorded feeds"


def test_the_artifact_runs_as_the_plain_function_with_its_choices(case, compiled) -> None:
    describe = load_function(case["spec"])
    inputs = list(load_function(case["data"])())
    with Pipeline(str(compiled)) as pipe:
        served = pipe.map(inputs, streams=3)
        assert pipe(inputs[0]) == served[0]
    sessions = {
        "embed": kiln.Session(case["models"]["embed"]),
        "cls": kiln.Session(str(compiled / "stages/cls.kiln")),
    }
    assert served == [describe(x, **sessions) for x in inputs]


def _compiled_at_pace(case, monkeypatch, pace: Speedup, name: str) -> dict:
    """The pipeline compiled with int8 tried, every stage timed at `pace`: its manifest."""
    monkeypatch.setattr(pipeline_compile, "stage_speedup", lambda *_: pace)
    out = case["root"] / f"{name}.kiln"
    compile_pipeline(case["spec"], case["models"], case["data"], out, precisions=("int8",),
                     metric=f"{case['root'] / 'glue.py'}:labels")  # fmt: skip
    return json.loads((out / "pipeline.json").read_text())


def test_a_lossy_choice_that_is_slower_is_not_kept_though_the_metric_holds(case, monkeypatch):
    manifest = _compiled_at_pace(case, monkeypatch, Speedup(0.8, (0.7, 0.9), SLOWER), "slow")
    assert {n: s["precision"] for n, s in manifest["stages"].items()} == {
        "embed": "fp32", "cls": "fp32"}  # fmt: skip
    for trial in manifest["search"]["trials"]:
        assert trial["metric"] == 1.0 and not trial["kept"]
        assert trial["reason"].startswith("slower: 0.80x") and trial["speed_verdict"] == SLOWER


def test_a_lossy_choice_no_faster_than_noise_is_not_kept(case, monkeypatch) -> None:
    manifest = _compiled_at_pace(case, monkeypatch, Speedup(1.02, (0.9, 1.1), SAME), "same")
    assert {s["precision"] for s in manifest["stages"].values()} == {"fp32"}
    for trial in manifest["search"]["trials"]:
        assert trial["metric"] == 1.0 and not trial["kept"]
        assert trial["reason"] == (
            "not faster: 1.02x the stage's current choice (rounds 0.90-1.10), "
            "no different within noise"
        )
        # The figures agree with the speedup: the stage's time over it.
        assert trial["stage_ms"] == pytest.approx(trial["baseline_ms"] / 1.02, rel=1e-3)


def test_of_two_lossy_choices_that_hold_the_faster_is_kept(case, monkeypatch) -> None:
    paces = {"int8": Speedup(1.3, (1.2, 1.4), FASTER), "bf16": Speedup(1.8, (1.6, 2.0), FASTER)}
    monkeypatch.setattr(pipeline_compile, "stage_speedup", lambda _s, p, _r: paces[p])
    stages = {"cls": pipeline_compile.Stage("cls", case["models"]["cls"])}
    fp32 = kiln.compile(case["models"]["cls"], case["root"] / "c32.kiln", force=True).path
    stages["cls"].candidates = {"fp32": fp32, "int8": fp32, "bf16": fp32}
    fn = load_function(f"{case['root'] / 'glue.py'}:describe")
    inputs = list(load_function(case["data"])())
    sessions = {name: kiln.Session(path) for name, path in case["models"].items()}
    reference = pipeline_compile.record(fn, sessions, inputs)

    def with_cls(x, *, cls):  # embed as it is, cls at each candidate
        return fn(x, embed=sessions["embed"], cls=cls)

    trials, _ = pipeline_compile._search(
        with_cls, stages, inputs, reference, lambda r, o: 1.0, 1.0, 0.0, lambda _: None
    )
    assert stages["cls"].choice == "bf16"
    by = {t.precision: t for t in trials}
    assert by["bf16"].kept and not by["int8"].kept and "bf16 was faster" in by["int8"].reason


def test_a_build_whose_stages_answer_wrong_together_is_refused_and_nothing_written(
    case, monkeypatch
) -> None:
    # Each artifact passes its own model's check on one input; run as the pipeline runs them,
    # they must still give the reference's results (here: a session that answers wrong).
    from kiln.pipeline.recording import Recording

    wrong = Recording(results=[{"label": -1, "embedding": []}] * 12)
    monkeypatch.setattr(pipeline_compile, "_run", lambda *_: wrong)
    out = case["root"] / "wrong.kiln"
    with pytest.raises(KilnError, match="though every stage passed its own check"):
        compile_pipeline(case["spec"], case["models"], case["data"], out)
    assert not out.exists()


def test_auto_tries_each_lossy_precision_this_cpu_runs(monkeypatch) -> None:
    from kiln.backends import openvino

    lossy = pipeline_compile.lossy_precisions
    assert lossy("fp32", "auto") == () and lossy("int8", "ort") == ("int8",)
    assert lossy("auto", "ort") == ("int8",)  # ONNX Runtime has no bf16 kernels here
    monkeypatch.setattr(openvino, "cpu_runs_bf16", lambda: True)
    assert lossy("auto", "openvino") == ("bf16", "int8")
    monkeypatch.setattr(openvino, "cpu_runs_bf16", lambda: False)
    assert lossy("auto", "openvino") == ("int8",)


def test_the_stage_is_timed_against_its_choice_on_its_recorded_calls(case) -> None:
    from kiln.pipeline.compile import Stage, stage_speedup
    from kiln.pipeline.recording import record

    sessions = {name: kiln.Session(path) for name, path in case["models"].items()}
    inputs = list(load_function(case["data"])())
    reference = record(load_function(case["spec"]), sessions, inputs)
    artifact = kiln.compile(case["models"]["cls"], case["root"] / "cls-fp32.kiln", force=True)
    stage = Stage("cls", case["models"]["cls"], {"fp32": artifact.path, "copy": artifact.path})
    pace = stage_speedup(stage, "copy", reference)
    assert pace.spread is not None and pace.spread[0] <= pace.value <= pace.spread[1]


def test_a_metric_over_labels_lets_the_embedding_go_int8(case) -> None:
    out = case["root"] / "labels.kiln"
    compile_pipeline(case["spec"], case["models"], case["data"], out, precisions=("int8",),
                     metric=f"{case['root'] / 'glue.py'}:labels")  # fmt: skip
    manifest = json.loads((out / "pipeline.json").read_text())
    assert {n: s["precision"] for n, s in manifest["stages"].items()} == {
        "embed": "int8",
        "cls": "int8",
    }


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"spec": "glue.py:nope"}, "has no function 'nope'"),
        ({"models": {"embed": "embed.onnx"}}, "gives none for cls"),
        ({"models": {"embed": "embed.onnx", "cls": "missing.onnx"}}, "no such file"),
        ({"data": "glue.py:nope"}, "has no function 'nope'"),
        ({"data": []}, "holds no inputs"),
        ({"metric": "glue.py:not_a_number"}, "returned str, not a number"),
        ({"metric": "accuracy"}, "use exact or MODULE:FUNCTION"),
        ({"spec": "glue.py:flaky"}, "differ between two runs"),
    ],
)
def test_bad_input_is_one_line_and_nothing_is_written(case, change, words) -> None:
    root = case["root"]
    here = {"spec": "glue.py:describe", "data": "glue.py:inputs", "metric": "exact",
            "models": {"embed": "embed.onnx", "cls": "cls.onnx"}} | change  # fmt: skip

    def absolute(value):  # the glue's specs under the case's directory
        return f"{root}/{value}" if isinstance(value, str) and ".py" in value else value

    models = {name: str(root / path) for name, path in here["models"].items()}
    out = root / "bad.kiln"
    with pytest.raises(KilnError, match=words):
        compile_pipeline(absolute(here["spec"]), models, absolute(here["data"]), out,
                         metric=absolute(here["metric"]))  # fmt: skip
    assert not out.exists()


def test_kiln_optimize_compiles_a_pipeline_from_the_command_line(case, monkeypatch, capsys):
    root = case["root"]
    out = root / "cli.kiln"
    models = [f"--model={name}={path}" for name, path in case["models"].items()]
    code, stdout, _ = kiln_cli(
        monkeypatch, capsys, "optimize", case["spec"], *models, "--data", case["data"],
        "--precision", "auto", "--streams", "4", "-o", str(out), "--json",
    )  # fmt: skip
    assert code == 0
    summary = json.loads(stdout)
    assert summary["stages"] == {"embed": "fp32", "cls": "int8"}  # exact: embed's int8 fails
    assert summary["streams"] == 4 and summary["metric"]["final"] == 1.0
    assert (out / "pipeline.json").is_file()
    # Each stage says whether its calls from several streams share a run, and why.
    assert set(summary["merging"]) == {"embed", "cls"}
    assert all(m["reason"] for m in summary["merging"].values())
    from kiln.cli.pipeline import _print

    _print(summary)
    table = capsys.readouterr().out
    assert "runs" in table and table.count("calls merged") + table.count("calls apart") == 2


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--model", "embed=embed.onnx"], "--data"),
        (["--model", "embed", "--data", "x"], "NAME=PATH"),
        (["--model", "embed=a.onnx", "--model", "embed=b.onnx", "--data", "x"], "given twice"),
        (["--data", "glue.py:inputs"], "gives none for embed"),
        (["--model", "embed=embed.onnx", "--model", "cls=cls.onnx", "--data", "glue.py:inputs",
          "--metric", "cosine"], "--metric cosine: use exact or MODULE:FUNCTION"),
    ],
)
def test_kiln_optimize_refuses_a_bad_pipeline_in_one_line(case, monkeypatch, capsys, args, words):
    monkeypatch.chdir(case["root"])
    code, _, err = kiln_cli(monkeypatch, capsys, "optimize", "glue.py:describe", *args,
                            "-o", "bad.kiln")  # fmt: skip
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    assert not (case["root"] / "bad.kiln").exists()


def test_kiln_run_writes_a_pipelines_results_as_json_lines(case, compiled, monkeypatch, capsys):
    out = case["root"] / "results.jsonl"
    code, _, err = kiln_cli(monkeypatch, capsys, "run", str(compiled), "--data", case["data"],
                            "--streams", "3", "-o", str(out))  # fmt: skip
    assert code == 0, err
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    inputs = list(load_function(case["data"])())
    with Pipeline(str(compiled)) as pipe:
        assert lines == [json.loads(json.dumps(pipe(x))) for x in inputs]


def test_kiln_bench_measures_a_pipeline_on_streams_against_the_plain_function(
    case, compiled, monkeypatch, capsys
):
    code, stdout, err = kiln_cli(
        monkeypatch, capsys, "bench", str(compiled), "--data", case["data"], "--streams", "1,3",
        "--against-pipeline", f"{case['root'] / 'glue.py'}:inputs_peer", "--rounds", "3", "--json",
    )  # fmt: skip
    assert code == 0, err
    result = json.loads(stdout)
    assert result["metric"] == "exact" and result["queries"] == 12 and result["rounds"] == 3
    for n in ("1", "3"):
        ways = result["streams"][n]
        for way in ("kiln", "plain", "peer"):
            figures = ways[way]
            assert figures["queries"] == figures["p99_backed_by"] == 36  # 3 rounds of 12
            assert len(figures["queries_per_s_rounds"]) == 3
            assert figures["p99_ms"] >= figures["p90_ms"] >= figures["p50_ms"] > 0
        low, high = ways["speedup_vs_plain_spread"]
        assert low <= ways["speedup_vs_plain"] <= high and ways["speedup_vs_plain_verdict"]
        assert ways["plain"]["metric"] == 1.0  # the fp32 pipeline itself
        assert ways["kiln"]["metric"] == 1.0  # the choices kept every result
        assert ways["peer"]["metric"] == 0.0  # the peer answers otherwise
        assert ways["kiln"]["stages"]["embed"]["calls"] == 12
        assert ways["speedup_vs_plain"] > 0
