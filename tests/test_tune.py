"""`kiln tune`: a study builds verified trials, measures them against the incumbent, keeps
its pick only when it beats the defaults beyond noise, resumes when interrupted, remembers
winners in the strategy library and warm-starts similar models from them."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import optuna
import pytest

import kiln
from kiln.config import CompileConfig
from kiln.tune import parse_objectives, plan_for, tune
from kiln.tune.library import Library, Record
from kiln.tune.signature import hardware
from kiln.tune.storage import default_url


def plan(model="zoo:resnet-tiny", trials=3, study=None, **overrides):
    settings = dict(
        objectives=parse_objectives(["latency"]), constraints=[], base=CompileConfig(),
        trials=trials, timeout_s=None, url=None, study=study, seconds_per_trial=0.3,
        seed=0, precisions=["fp32"], engines=["ort"], confirm_runs=200,
    )  # fmt: skip
    settings.update(overrides)
    made = plan_for(model, **settings)
    made.confirm_seconds = 1.0
    return made


def finished(study_name: str) -> list[optuna.trial.FrozenTrial]:
    study = optuna.load_study(study_name=study_name, storage=default_url())
    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    return study.get_trials(states=states)


def test_a_study_writes_a_verified_artifact_and_remembers_its_winner(tmp_path):
    result = tune(plan(), tmp_path / "tuned.kiln", say=lambda _m: None)
    session = kiln.Session(result.artifact)
    feeds = {"input": np.random.rand(1, 3, 32, 32).astype(np.float32)}
    assert session.run(None, feeds)[0].shape == (1, 10)
    manifest = json.loads((tmp_path / "tuned.kiln" / "manifest.json").read_text())
    assert manifest["verification"]["ok"]
    speed = result.gains["speedup"]
    assert speed["low"] <= speed["value"] <= speed["high"] and speed["runs"] >= 200
    assert result.gains["verdict"] in ("better", "no better", "worse", "the defaults measured best")
    if result.gains["verdict"] != "better":  # kept only when measured better
        assert result.changed == {}
    assert result.trials["COMPLETE"] + result.trials.get("PRUNED", 0) == 3
    records = Library(default_url()).records(hardware()["class"])
    assert [r.model for r in records] == ["resnet-tiny"] and records[0].id == result.library_id


def test_an_interrupted_study_resumes_where_it_stopped(tmp_path):
    tune(plan(trials=2, study="resume"), None, say=lambda _m: None)
    first = [t.params for t in finished("resume")]
    tune(plan(trials=4, study="resume"), None, say=lambda _m: None)
    after = finished("resume")
    assert len(after) == 4 and [t.params for t in after[:2]] == first


def test_a_new_model_is_warm_started_from_the_nearest_winner_on_this_hardware_only():
    library = Library(default_url())
    signature = {"ops": {"Conv": 1.0}, "nodes": 10, "flops": {"conv": 1, "matmul": 0},
                 "parameters": 1, "dynamic_dims": []}  # fmt: skip
    winner = {"engine": "ort", "ort.precision": "fp32", "ort.threads": 1}
    here, elsewhere = hardware(), {**hardware(), "class": "another-machine"}
    for machine, model in ((here, "conv-net"), (elsewhere, "other-conv-net")):
        library.add(Record("study", machine, model, signature, "latency", winner, {}, {}, [], {}))
    result = tune(plan(trials=2, study="warm"), None, say=lambda _m: None)
    assert [w.split(" ")[0] for w in result.warm_start] == ["conv-net"]
    params = [t.params for t in finished("warm")]
    # Kiln's defaults are the first trial; the winner goes next, before the seeds.
    assert params[1].get("ort.threads") == 1, params


@pytest.mark.parametrize(
    "args, message",
    [
        (["--objective", "speed"], "unknown objective 'speed'"),
        (["--time", "0"], "--time 0: give a positive duration"),
        (["--trials", "0"], "--trials 0: give 1 or more"),
        (["--max-p50", "fast"], "--max-p50 fast: expected a number"),
        (["--max-p50", "20"], "--max-p50 20: expected a number with a unit (us, ms, s)"),
        (["--max-memory", "2"], "--max-memory 2: expected a number with a unit"),
        (["--storage", "postgresql+psycopg://kiln@127.0.0.1:1/none"], "cannot connect"),
        (["--storage", "nonsense://"], "not a database URL"),
        (["--clients", "4"], "--clients measures served throughput: add --objective throughput"),
        (["--traffic", "t.json"], "--traffic is replayed by served clients: add --clients N"),
    ],
)
def test_bad_input_is_one_line_before_any_work(args, message):
    outcome = subprocess.run(
        [sys.executable, "-m", "kiln", "tune", "zoo:resnet-tiny", *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert outcome.returncode == 2, outcome.stderr
    lines = outcome.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], outcome.stderr


def test_a_budget_no_configuration_meets_is_one_line_and_the_study_stays(tmp_path):
    with pytest.raises(kiln.KilnError, match="no configuration met the budget in 2 finished"):
        tune(plan(trials=2, study="impossible", precisions=["int8"], base=CompileConfig(
            metric="cosine", max_drop=0.0)), tmp_path / "x.kiln", say=lambda _m: None)  # fmt: skip
    assert not (tmp_path / "x.kiln").exists()
    assert {t.state.name for t in finished("impossible")} == {"PRUNED"}


def test_a_served_study_hands_its_batcher_settings_to_kiln_serve(tmp_path):
    from kiln.serve.serving import batcher_settings
    from kiln.tune.serving import DELAYS_MS
    from kiln.tune.space import BATCHES

    made = plan(objectives=parse_objectives(["throughput"]), clients=4, trials=2)
    assert made.study.startswith("resnet-tiny-throughput-served4")
    result = tune(made, tmp_path / "served.kiln", say=lambda _m: None)
    serving = result.gains["serving"]
    assert serving["clients"] == 4 and serving["max_batch"] in BATCHES
    assert serving["max_delay_ms"] in DELAYS_MS
    assert "throughput_ratio" in result.gains
    out = str(tmp_path / "served.kiln")
    assert batcher_settings(out, None, None) == (serving["max_batch"], serving["max_delay_ms"])
    assert batcher_settings(out, 3, None)[0] == 3  # a flag wins over the tuned value
    assert batcher_settings("zoo:resnet-tiny", None, None) == (16, 0.0)  # no delay by default


TRAFFIC = [{"seq": s} for s in (3, 5, 6, 8, 9, 11, 12, 14, 15, 16) * 3]


def test_a_served_study_searches_bucket_sets_for_the_recorded_traffic(tmp_path):
    (tmp_path / "traffic.json").write_text(json.dumps(TRAFFIC))
    made = plan("zoo:bert-tiny", objectives=parse_objectives(["throughput"]), clients=4,
                trials=3, traffic=tmp_path / "traffic.json")  # fmt: skip
    assert "-served4-traffic" in made.study
    result = tune(made, tmp_path / "served.kiln", say=lambda _m: None)
    bucketed = [h for h in result.history if h["params"].get("serve.buckets_per_dim")]
    assert bucketed and bucketed[0]["state"] == "COMPLETE"  # the quartiles seed was measured
    buckets = result.gains["serving"]["buckets"]
    manifest = json.loads((tmp_path / "served.kiln" / "manifest.json").read_text())
    assert manifest["buckets"] == buckets  # where kiln serve's Session finds them
    session = kiln.Session(tmp_path / "served.kiln")
    assert session.buckets == buckets
    feeds = {n: np.ones((1, 7), np.int64) for n in ("input_ids", "attention_mask",
                                                    "token_type_ids")}  # fmt: skip
    assert session.run(None, feeds)[0].shape[:2] == (1, 7)  # padded to a bucket, sliced back


def test_a_bucketed_trial_serves_the_traffic_through_a_session_with_its_buckets():
    from kiln.ir.load import load_model
    from kiln.tune.bench import Workbench
    from kiln.tune.space import Space, choice_of, default_params

    model = load_model("zoo:bert-tiny")
    objectives = parse_objectives(["throughput"])
    bench = Workbench(model, CompileConfig(), objectives, [], 0.3, traffic=[
        {"batch": 1, **t} for t in TRAFFIC])  # fmt: skip
    space = Space(("ort",), ("fp32",), cores=2, throughput=True, clients=4, buckets=True)
    params = default_params(space) | {"serve.buckets_per_dim": 2, "serve.max_delay_ms": 2.0}
    built = bench.build(choice_of(params, space, model.model, CompileConfig()))
    assert built.buckets == {"seq": [11, 16]}  # the traffic's median (higher) and largest
    served = built.served(seconds=0.5)
    assert served.rate > 0 and served.batches < len(served.latencies_s)  # requests merged


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "not a JSON file"),
        ("[]", "expected a non-empty JSON list of requests"),
        ('[{"seq": 0}]', "request 0 is"),
        ('[{"seq": 8}, {"width": 3}]', "request 1 sizes 'width', which the model has no dim"),
        ('[{"batch": 2}]', "request 0 gives no size for dim 'seq'"),
    ],
)
def test_bad_traffic_is_one_line_and_no_study_is_made(tmp_path, content, message):
    (tmp_path / "t.json").write_text(content)
    outcome = subprocess.run(
        [sys.executable, "-m", "kiln", "tune", "zoo:bert-tiny", "--objective", "throughput",
         "--clients", "2", "--traffic", str(tmp_path / "t.json"), "--study", "bad-traffic"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert outcome.returncode == 2, outcome.stderr
    lines = outcome.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], outcome.stderr
    assert "bad-traffic" not in optuna.get_all_study_names(default_url())


def test_a_resumed_study_checks_its_pick_against_the_limits_given_now(tmp_path):
    from kiln.tune.objectives import parse_constraint

    easy, impossible = parse_constraint("max_p50", "20s"), parse_constraint("max_p50", "1us")
    tune(plan("zoo:bert-tiny", trials=1, study="limits", constraints=[easy]), None,
         say=lambda _m: None)  # fmt: skip
    # The same study, resumed under a limit its one trial does not meet: refused, no artifact.
    with pytest.raises(kiln.KilnError, match="1 measured outside --max-p50 1us"):
        tune(plan("zoo:bert-tiny", trials=1, study="limits", constraints=[impossible]),
             tmp_path / "x.kiln", say=lambda _m: None)  # fmt: skip
    assert not (tmp_path / "x.kiln").exists()


def test_time_bounds_the_whole_command_confirmation_included(monkeypatch):
    import kiln.tune.study as study_module

    asked = {}
    real = study_module.confirm

    def spy(*args, **kwargs):
        asked.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(study_module, "confirm", spy)
    made = plan("zoo:bert-tiny", trials=1, study="timed", timeout_s=20.0)
    made.confirm_seconds = 30.0  # the default: more than --time holds
    tune(made, None, say=lambda _m: None)
    assert asked["limit_s"] is not None and asked["limit_s"] <= 20.0
    assert asked["seconds"] == 0.0  # the pick is the defaults: nothing to tighten


def test_an_artifact_is_tuned_from_the_source_model_its_manifest_records(tmp_path):
    artifact = kiln.compile("zoo:bert-tiny", tmp_path / "b.kiln", rounds=0)
    assert plan(str(artifact.path), trials=1).source == "zoo:bert-tiny"
    (tmp_path / "not-an-artifact").mkdir()
    with pytest.raises(kiln.KilnError, match="not a Kiln artifact"):
        plan(str(tmp_path / "not-an-artifact"))


def test_a_pt2_is_tuned_and_verified_on_its_saved_example(tmp_path):
    torch = pytest.importorskip("torch")
    module = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.ReLU())
    program = torch.export.export(module, (torch.randn(2, 8),))
    torch.export.save(program, tmp_path / "m.pt2")
    result = tune(plan(str(tmp_path / "m.pt2"), trials=1), tmp_path / "m.kiln",
                  say=lambda _m: None)  # fmt: skip
    assert re.match(r"m-[0-9a-f]{8}-latency-", result.study), result.study  # the file, its digest
    manifest = json.loads((tmp_path / "m.kiln" / "manifest.json").read_text())
    assert manifest["verification"]["ok"] and manifest["source"]["path"].endswith("m.pt2")


def test_inline_traffic_json_is_read_as_the_requests_themselves():
    from kiln.tune.traffic import load_traffic

    assert load_traffic('[{"seq": 12}, {"seq": 40}]', default_url()) == [{"seq": 12},
                                                                          {"seq": 40}]  # fmt: skip
    with pytest.raises(kiln.KilnError, match="request 0 is"):
        load_traffic('[{"seq": 0}]', default_url())
