"""The tuner's measuring and wording: intervals that contain the truth, tails over windows,
constraints in the CLI's units, the search space's projection of foreign parameters."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest

import kiln
from kiln import zoo
from kiln.config import CompileConfig
from kiln.timing import bootstrap
from kiln.tune.measure import tails
from kiln.tune.objectives import parse_constraint, parse_objectives
from kiln.tune.space import Space, project


def test_bootstrap_interval_holds_the_median_and_narrows_with_data():
    rng = np.random.default_rng(0)
    few, many = (
        bootstrap(list(rng.normal(1.0, 0.1, 10))),
        bootstrap(list(rng.normal(1.0, 0.1, 400))),
    )
    assert few.low <= few.value <= few.high and many.low <= 1.0 <= many.high
    assert many.halfwidth < few.halfwidth


def test_tails_are_per_window_not_one_runs_tail():
    seconds = [0.001] * 1000
    seconds[10] = 0.5  # one stall: one window's P99, not the median window's
    got = tails(seconds)
    assert got.p99_ms.value == pytest.approx(1.0) and got.jitter.value == pytest.approx(0.0)
    assert got.runs == 1000


@pytest.mark.parametrize(
    "flag, text, measure, bound",
    [("max_p50", "20ms", "p50_ms", 20.0), ("max_p99", "0.5s", "p99_ms", 500.0),
     ("max_memory", "2GiB", "memory_mib", 2048.0),
     ("max_memory", "100MB", "memory_mib", 1e8 / 2**20),  # MB is decimal, MiB binary
     ("max_memory", "2GB", "memory_mib", 2e9 / 2**20),
     ("min_throughput", "300", "throughput", 300.0),
     ("max_jitter", "0.2", "jitter", 0.2)],
)  # fmt: skip
def test_constraints_read_their_units(flag, text, measure, bound):
    constraint = parse_constraint(flag, text)
    assert (constraint.measure, constraint.bound) == (measure, pytest.approx(bound))


def test_unknown_units_and_objectives_name_the_flag():
    with pytest.raises(kiln.KilnError, match="--max-p50 20 apples: expected a number"):
        parse_constraint("max_p50", "20 apples")
    with pytest.raises(kiln.KilnError, match="unknown objective 'fast'"):
        parse_objectives(["latency,fast"])
    assert [o.name for o in parse_objectives(["latency,p99", "latency"])] == ["latency", "p99"]


def test_a_past_winner_is_projected_onto_this_space():
    model = ir.serde.deserialize_model(zoo.build("resnet-tiny"))
    space = Space(("ort",), ("fp32",), cores=2)
    params = {"engine": "openvino", "ort.threads": 7, "ort.spinning": False, "bogus": 1}
    assert project(params, space, model, CompileConfig()) == {"ort.spinning": False}


def test_with_the_attention_group_off_no_attention_is_fused():
    """The switch covers every attention rewrite: a trial with it off runs the blocks as
    exported, so the tuner can measure the fused op against them."""
    from kiln.passes import default_pipeline, run_pipeline
    from kiln.tune.space import PASS_GROUPS

    names = {s.name for s in default_pipeline("ort")}
    assert {n for n in names if "attention" in n} <= set(PASS_GROUPS["attention"])
    model = ir.serde.deserialize_model(zoo.build("bert-tiny"))
    off = [s for s in default_pipeline("ort") if s.name not in PASS_GROUPS["attention"]]
    run_pipeline(model, off)
    ops = {n.op_type for n in model.graph}
    assert "Softmax" in ops and not ops & {"Attention", "MultiHeadAttention"}


def test_reconfigure_swaps_engine_options_without_changing_outputs():
    session = kiln.Session("zoo:resnet-tiny", options={"intra_op_threads": 1})
    feeds = {"input": np.random.default_rng(0).random((2, 3, 32, 32), np.float32)}
    before = session.run(None, feeds)[0]
    session.reconfigure({"intra_op_threads": 2, "spinning": False})
    assert session.options["intra_op_threads"] == 2 and session.monitor.swaps == 1
    np.testing.assert_allclose(session.run(None, feeds)[0], before, rtol=1e-5, atol=1e-6)
    with pytest.raises(kiln.KilnError, match="unknown option 'threads'"):
        session.reconfigure({"threads": 4})
    assert session.options["intra_op_threads"] == 2


def test_a_study_starts_where_auto_ends_the_engines_defaults_first():
    from kiln.tune.space import seed_params

    space = Space(("ort", "openvino"), ("fp32", "bf16", "int8", "int4"), cores=2)
    pairs = [(p["engine"], p[f"{p['engine']}.precision"]) for p in seed_params(space)]
    assert pairs == [("ort", "fp32"), ("openvino", "fp32"), ("ort", "int8"), ("openvino", "int8")]
    model = ir.serde.deserialize_model(zoo.build("resnet-tiny"))
    for params in seed_params(space):  # each lies wholly in the space
        assert project(params, space, model, CompileConfig()).keys() >= {"engine"}


def test_a_throughput_study_starts_at_the_large_batch_on_one_and_on_every_core():
    from kiln.tune.space import BATCHES, seed_params

    space = Space(("ort", "openvino"), ("fp32", "int8"), cores=2, throughput=True)
    seeds = seed_params(space)
    assert seeds[0]["batch"] == 1 and seeds[0]["concurrency"] == 1  # the defaults come first
    large = [(p["batch"], p["concurrency"]) for p in seeds[1:]]
    assert set(large) == {(max(BATCHES), 1), (max(BATCHES), 2)}
    model = ir.serde.deserialize_model(zoo.build("resnet-tiny"))
    for params in seeds:  # the batch, streams and threads survive the projection
        kept = project(params, space, model, CompileConfig())
        assert {k: kept.get(k) for k in ("batch", "concurrency")} == {
            k: params[k] for k in ("batch", "concurrency")
        }
        threads = "ort.threads" if params["engine"] == "ort" else "openvino.threads"
        assert kept[threads] == params[threads]


def test_served_requests_are_batched_and_each_answer_is_its_own():
    from kiln.tune.serving import merged_runner, serve

    runs: list[int] = []

    def run(feeds):  # the row sums: an answer that says which request it was
        runs.append(len(feeds["x"]))
        return [feeds["x"].sum(axis=1)]

    served = serve(merged_runner(run), [{"x": np.ones((1, 4), np.float32)}], clients=8, max_batch=8,
                   max_delay_ms=20.0, seconds=0.5)  # fmt: skip
    assert served.rate > 0 and served.latencies_s and served.p99_ms > 0
    assert served.batches == len(runs) < len(served.latencies_s)  # requests shared runs
    assert max(runs) > 1 and max(runs) <= 8


def test_a_failing_engine_fails_the_served_window():
    from kiln.tune.serving import merged_runner, serve

    def broken(_feeds):
        raise RuntimeError("engine gone")

    with pytest.raises(RuntimeError, match="engine gone"):
        serve(merged_runner(broken), [{"x": np.ones((1, 4), np.float32)}], clients=2, max_batch=4,
              max_delay_ms=1.0, seconds=0.2)  # fmt: skip


def test_a_served_study_searches_the_batchers_knobs_from_kiln_serves_defaults():
    from kiln.tune.space import SERVE_DEFAULTS, choice_of, seed_params

    space = Space(("ort",), ("fp32",), cores=2, throughput=True, clients=8)
    seeds = seed_params(space)
    assert {k: seeds[0][k] for k in SERVE_DEFAULTS} == SERVE_DEFAULTS  # kiln serve's own first
    assert {(p["serve.max_batch"], p["serve.max_delay_ms"]) for p in seeds[1:]} == {(8, 0.0)}
    model = ir.serde.deserialize_model(zoo.build("resnet-tiny"))
    choice = choice_of(seeds[-1], space, model, CompileConfig())
    assert choice.serving() == {"max_batch": 8, "max_delay_ms": 0.0, "clients": 8}
    assert choice.concurrency == 1 and "batch" not in project(seeds[-1], space, model,
                                                              CompileConfig())  # fmt: skip


def test_traffic_recorded_by_the_feedback_loop_is_replayed_in_its_proportions():
    from kiln.tune.library import Library
    from kiln.tune.storage import default_url
    from kiln.tune.traffic import load_traffic

    library = Library(default_url())
    library.add_window("bert-tiny", {"shapes": {"batch=4,seq=8": 30, "batch=1,seq=16": 10}})
    library.add_window("bert-tiny", {"shapes": {"batch=2,seq=8": 30}})
    traffic = load_traffic("served:bert-tiny", default_url())
    seqs = [t["seq"] for t in traffic]
    assert all(set(t) == {"seq"} for t in traffic)  # merged batches are not requests
    assert seqs.count(8) / seqs.count(16) == pytest.approx(6, rel=0.05)
    assert set(seqs[:20]) == {8, 16}  # interleaved, not one shape after the other
    with pytest.raises(kiln.KilnError, match="no windows with dynamic dims for 'gpt2-tiny'"):
        load_traffic("served:gpt2-tiny", default_url())


def test_the_confirmed_speedup_is_the_ratio_of_the_p50s_printed_beside_it(monkeypatch):
    import kiln.tune.confirm as confirm_module
    from kiln.tune.bench import Built
    from kiln.tune.measure import Duel

    # Rounds where the median of per-round ratios (1.0) and the ratio of the two P50s
    # (0.0942 / 0.1 = 0.942) disagree, as in the issue.
    tuned = [[0.0942e-3] * 5, [0.0942e-3] * 5, [0.2e-3] * 5, [0.0942e-3] * 5, [0.3e-3] * 5]
    base = [[0.0942e-3] * 5, [0.0942e-3] * 5, [0.1e-3] * 5, [0.1e-3] * 5, [0.3e-3] * 5]
    monkeypatch.setattr(confirm_module, "duel", lambda *a, **k: Duel(
        confirm_module.speedup_interval(tuned, base), tuned, base))  # fmt: skip
    built = Built(choice=None, result=None, runners=[lambda: None])
    gains = confirm_module.confirm(built, built, runs=10, seconds=0.0, memory=False)
    p50 = gains["defaults"]["p50_ms"]["value"], gains["tuned"]["p50_ms"]["value"]
    assert gains["speedup"]["value"] == pytest.approx(p50[0] / p50[1])
    assert p50 == pytest.approx((0.1, 0.0942))
    speed = gains["speedup"]
    assert speed["low"] <= speed["value"] <= speed["high"]


def test_speedup_interval_is_kiln_timings_speedup_with_an_interval():
    from kiln.timing import speedup
    from kiln.tune.measure import speedup_interval

    rng = np.random.default_rng(0)
    base = [list(rng.normal(2e-3, 1e-4, 10)) for _ in range(12)]
    fast = [list(rng.normal(1e-3, 1e-4, 10)) for _ in range(12)]
    got = speedup_interval(base, fast)
    assert got.value == speedup(base, fast).value and got.low <= got.value <= got.high
    assert got.low > 1.5  # twice as fast: the whole interval says so


def test_a_sessions_memory_is_its_peak_in_a_process_of_its_own(tmp_path):
    from kiln.runtime.footprint import peak_memory

    artifact = kiln.compile("zoo:bert-tiny", tmp_path / "b.kiln")
    ballast = np.ones(50_000_000, np.float32)  # 190 MiB in this process: not the session's
    got = peak_memory(artifact.path, runs=2)
    assert 0 < got["load_mib"] <= got["peak_mib"] < 100, got
    assert got["baseline_mib"] < ballast.nbytes / 2**20, got
    with pytest.raises(kiln.KilnError, match="measuring the memory of"):
        peak_memory(tmp_path / "missing.kiln", runs=1)


def test_a_trials_memory_is_its_sessions_peak_not_this_processs_growth():
    from kiln.ir.load import load_model
    from kiln.tune.bench import Workbench
    from kiln.tune.space import choice_of, default_params

    model = load_model("zoo:bert-tiny")
    bench = Workbench(model, CompileConfig(), parse_objectives(["memory"]), [], 0.3)
    space = Space(("ort",), ("fp32",), cores=2)
    choice = choice_of(default_params(space), space, model.model, CompileConfig())
    first, again = bench.build(choice), bench.build(choice)  # the second compile is cached
    assert first.memory_mib > 1 and again.memory_mib > 1  # growth read 0.0 MiB here
    assert bench.measure(first).measures["memory_mib"] == first.memory_mib


def _result(**gains_extra):
    interval = {"value": 0.1, "low": 0.09, "high": 0.11}
    side = {"p50_ms": interval, "p99_ms": interval, "jitter": interval, "memory_mib": None}
    defaults = {"engine": "ort", "ort.precision": "fp32", "ort.threads": 2}
    return {
        "study": "s", "storage": "sqlite:///x.db", "artifact": None,
        "trials": {"COMPLETE": 2, "PRUNED": 1, "WAITING": 3},
        "pick": {"trial": 1}, "defaults": {"params": defaults}, "changed": {},
        "gains": {"verdict": "no better", "tuned": side, "defaults": side,
                  "speedup": {**interval, "runs": 100},
                  "measured": {"trial": 1, "engine": "ort", "precision": "int8",
                               "changed": {"ort.precision": ["fp32", "int8"]}},
                  **gains_extra},
        "pareto": [{"trial": 1, "values": [0.09], "params": {}}], "warm_start": [],
        "objectives": [{"name": "latency", "unit": "ms", "direction": "minimize"}],
        "history": [
            {"trial": 0, "state": "COMPLETE", "values": [0.1], "params": defaults,
             "outside": [], "refused": None, "duplicate_of": None},
            {"trial": 1, "state": "COMPLETE", "values": [0.09],
             "params": {**defaults, "ort.precision": "int8"}, "outside": [], "refused": None,
             "duplicate_of": None},
            {"trial": 2, "state": "PRUNED", "values": None, "params": {"engine": "openvino"},
             "outside": [], "refused": "int4 is not supported", "duplicate_of": None},
        ],
        "importances": {},
    }  # fmt: skip


def test_the_tune_table_names_the_configuration_measured_and_explains_the_states():
    from rich.console import Console

    from kiln.report.tune import print_tune

    console = Console(record=True, width=200)
    print_tune(_result(), console)
    text = console.export_text()
    assert "tuned (trial 1)" in text and "ort int8" in text and "ort.precision" in text
    assert "3 waiting (queued seed or warm-start configurations not run yet" in text


def test_the_tune_report_lists_every_trial_with_its_configuration_and_outcome():
    from kiln.report.tune import tune_html

    page = tune_html(_result(), ["latency"])
    table = page[page.index("every trial") :]
    assert "latency (ms)" in table and "best so far" in table
    assert "picked, Pareto front" in table and "refused: int4 is not supported" in table
    assert "ort.precision=int8" in table and "optuna-dashboard sqlite:///x.db" in page
    assert "<td>ort.precision</td><td>fp32</td><td>int8</td>" in page  # the knobs table


def test_two_models_of_one_file_name_are_two_studies(tmp_path):
    from onnx import TensorProto, helper

    from kiln.tune.study import plan_for

    def model(folder: str, op: str) -> str:
        graph = helper.make_graph(
            [helper.make_node(op, ["x"], ["y"])], op,
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
        )  # fmt: skip
        (tmp_path / folder).mkdir()
        path = tmp_path / folder / "net.onnx"
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
        return str(path)

    first, second = model("a", "Relu"), model("b", "Sigmoid")
    settings = dict(
        objectives=parse_objectives(["latency"]), constraints=[], base=CompileConfig(),
        trials=2, timeout_s=None, study=None, url=f"sqlite:///{tmp_path / 'tune.db'}",
    )  # fmt: skip
    names = {plan_for(path, **settings).study for path in (first, second)}
    assert len(names) == 2 and all(name.startswith("net-") for name in names)
    assert plan_for(first, **settings).study == plan_for(first, **settings).study  # resumable

    # A --shape naming neither an input nor a dim is refused before any trial runs.
    settings["base"] = CompileConfig(shapes={"image": (1, 4)})
    with pytest.raises(kiln.KilnError, match="--shape names 'image'.*inputs: x"):
        plan_for(first, **settings)
