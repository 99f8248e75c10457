"""`kiln profile` and `kiln compare` on a pipeline artifact: each query split into glue,
queueing and compute per stage (adding up to its time), a Perfetto trace with a track per
stream and per stage, the stage whose choice changed the results named; bad input refused in
one line."""

from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest
from cli_helpers import kiln_cli
from test_pipeline_compile import GLUE, WIDTH, _matmul

from kiln.pipeline import compile as pipeline_compile
from kiln.pipeline import compile_pipeline
from kiln.pipeline.compare import compare_pipeline
from kiln.pipeline.profile import findings, profile_pipeline
from kiln.timing import FASTER, Speedup

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> dict:
    """Both stages int8: the metric over labels allows the embedding's int8, which `exact`
    would not. The search's speed rule is held fixed: int8 does not pay on models this small."""
    rng = np.random.default_rng(0)
    root = tmp_path_factory.mktemp("pipeline-profile")
    (root / "glue.py").write_text(textwrap.dedent(GLUE))
    identity = np.zeros((WIDTH, 4), np.float32)
    identity[:4, :4] = np.eye(4)
    noise = 0.01 * rng.standard_normal((WIDTH, 4)).astype(np.float32)
    models = {
        "embed": str(_matmul(root / "embed.onnx", rng.standard_normal((WIDTH, WIDTH), np.float32))),
        "cls": str(_matmul(root / "cls.onnx", identity + noise)),
    }
    data = f"{root / 'glue.py'}:inputs"
    faster = Speedup(1.5, (1.2, 1.8), FASTER)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline_compile, "stage_speedup", lambda *_: faster)
        out = compile_pipeline(f"{root / 'glue.py'}:describe", models, data, root / "d.kiln",
                               metric=f"{root / 'glue.py'}:labels",
                               precisions=("int8",))  # fmt: skip
    return {"root": root, "artifact": str(out), "data": data}


def test_each_query_splits_into_glue_queue_and_compute_adding_up_to_its_time(case) -> None:
    result = profile_pipeline(case["artifact"], case["data"], streams=3)
    assert result["queries"] == 12 and result["streams"] == 3
    split = result["split"]
    parts = split["glue"]["total_ms"] + sum(
        p["queue"]["total_ms"] + p["compute"]["total_ms"] for p in split["stages"].values()
    )
    whole = result["query"]["total_ms"]
    assert parts == pytest.approx(whole, rel=1e-3, abs=0.01)
    assert sum(p["share"] for s in split["stages"].values() for p in s.values()) + split["glue"][
        "share"
    ] == pytest.approx(1.0, abs=1e-3)
    for name in ("embed", "cls"):
        stage = result["stages"][name]
        assert stage["calls"] == 12 and stage["executions"] >= 1 and stage["precision"] == "int8"
        assert split["stages"][name]["compute"]["total_ms"] > 0
    assert result["findings"] and all(isinstance(line, str) for line in result["findings"])


def _split(glue: float, queue: float, compute: float, batch: float, streams: int = 4) -> dict:
    def part(share: float) -> dict:
        return {"median_ms": 0.0, "total_ms": 100 * share, "share": share}

    stage = {"calls": 10, "executions": round(10 / batch), "mean_batch": batch,
             "precision": "fp32"}  # fmt: skip
    rec = {"queue": part(queue), "compute": part(compute)}
    split = {"glue": part(glue), "stages": {"rec": rec}}
    return {"streams": streams, "max_delay_ms": 2.0, "stages": {"rec": stage}, "split": split}


def test_findings_name_the_stage_and_the_setting() -> None:
    (lonely,) = findings(_split(glue=0.1, queue=0.5, compute=0.3, batch=1.1))
    assert lonely.startswith("stage rec: 50% of query time queued")
    assert "mean batch 1.1 at 4 streams → fewer streams or a shorter max delay" in lonely
    (busy,) = findings(_split(glue=0.1, queue=0.6, compute=0.3, batch=3.0))  # 6 ms a call
    assert "the streams wait for it → a faster choice for it" in busy
    assert findings(_split(glue=0.1, queue=0.0, compute=0.9, batch=1.0))[0].startswith(
        "stage rec: 90% of query time computing at fp32 → try int8"
    )
    (glue,) = findings(_split(glue=0.6, queue=0.1, compute=0.3, batch=1.0))
    assert glue.startswith("glue is 60% of the time → fold array work (kiln.pipeline.ops)")
    # A stage whose calls run apart (its batch measured no faster) waits for no company.
    apart = _split(glue=0.1, queue=0.5, compute=0.3, batch=1.0)
    apart["stages"]["rec"]["merges"] = False
    (waited,) = findings(apart)
    assert "with its calls run apart (a batch measured no faster) at 4 streams" in waited
    assert "the streams wait for it → a faster choice for it" in waited


def test_the_trace_has_a_track_per_stream_and_per_stage(case, tmp_path) -> None:
    trace = tmp_path / "trace.json"
    profile_pipeline(case["artifact"], case["data"], streams=2, trace=trace)
    events = json.loads(trace.read_text())["traceEvents"]
    tracks = {e["args"]["name"]: e["tid"] for e in events if e["name"] == "thread_name"}
    assert set(tracks) == {"stream 0", "stream 1", "stage embed", "stage cls"}
    assert len(set(tracks.values())) == 4
    spans = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 and e["pid"] == 1 for e in spans)
    on_streams = {tracks["stream 0"], tracks["stream 1"]}
    assert {e["cat"] for e in spans if e["tid"] in on_streams} == {
        "query", "glue", "queue", "compute"
    }  # fmt: skip
    assert sum(e["cat"] == "query" for e in spans) == 12
    for stage in ("embed", "cls"):
        batches = [e for e in spans if e["tid"] == tracks[f"stage {stage}"]]
        assert batches and sum(e["args"]["calls"] for e in batches) == 12


def test_compare_names_the_stage_whose_int8_changed_the_result(case) -> None:
    result = compare_pipeline(case["artifact"], case["data"], "exact")
    assert result["fp32"] == 1.0 and result["chosen"] < 1.0
    embed, cls = result["stages"]["embed"], result["stages"]["cls"]
    assert embed["precision"] == "int8" and embed["changed"] > 0
    assert embed["metric_with_it_at_fp32"] == 1.0  # the labels survive the classifier's int8
    assert embed["first"][0]["max_abs_diff"] > 0 and embed["first"][0]["calls"] == [1, 1]
    assert cls["changed"] == 0
    assert result["moved_most"] == "embed" and "stage embed" in result["verdict"]


def test_kiln_profile_and_compare_take_a_pipeline_artifact(case, monkeypatch, capsys) -> None:
    trace = case["root"] / "cli-trace.json"
    code, stdout, err = kiln_cli(
        monkeypatch, capsys, "profile", case["artifact"], "--data", case["data"],
        "--streams", "2", "--trace", str(trace), "--json",
    )  # fmt: skip
    assert code == 0, err
    assert json.loads(stdout)["stages"]["embed"]["calls"] == 12 and trace.is_file()
    code, stdout, err = kiln_cli(monkeypatch, capsys, "compare", case["artifact"], "--data",
                                 case["data"], "--metric", "exact")  # fmt: skip
    assert code == 0, err
    assert "stage embed moved the result most" in " ".join(stdout.split())


@pytest.mark.parametrize("verb", ["profile", "compare"])
@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["ARTIFACT"], "give the inputs to run, --data"),
        (["nothing.kiln", "--data", "DATA"], "nothing.kiln: no such file or directory"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(case, monkeypatch, capsys, verb, args, words) -> None:
    args = [{"ARTIFACT": case["artifact"], "DATA": case["data"]}.get(a, a) for a in args]
    code, _, err = kiln_cli(monkeypatch, capsys, verb, *args)
    assert code == 2 and words in err and len(err.strip().splitlines()) == 1, err
