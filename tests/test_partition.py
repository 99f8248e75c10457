"""Partitioned artifacts on zoo:two-tower-tiny: a model's independent branches compiled as parts
on their own engines, verified as a whole, reopened from disk and run at once.

One partitioned artifact (image on OpenVINO, the text tower and the join on ONNX Runtime) is
built once per module through `kiln.compile`; `--partition auto` runs once through the CLI
(in this process: a `kiln` process would pay the imports again).
"""

from __future__ import annotations

import json
import sys
import threading

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import kiln
from kiln import zoo
from kiln.artifact import read_artifact
from kiln.artifact.parts import PARTS_DIR
from kiln.artifact.store import read_partitioned
from kiln.backends import available_backends
from kiln.errors import KilnError
from kiln.ir import load_model, stamp_origins
from kiln.ir.inputs import synthesize
from kiln.partition.graph import find_cuts
from kiln.partition.measure import cores
from kiln.runtime import PartitionedSession, SessionLike
from kiln.verify import FP32_TOLERANCE, check_output

MODEL = "zoo:two-tower-tiny"
PLACEMENT = "image=openvino,text=ort"  # the join: the config's engine, ort
BRANCHES = ("image", "text")


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> kiln.compiler.api.Artifact:
    where = tmp_path_factory.mktemp("partition") / "tt.kiln"
    return kiln.compile(MODEL, where, partition=PLACEMENT)


@pytest.fixture(scope="module")
def original() -> ort.InferenceSession:
    return ort.InferenceSession(zoo.build("two-tower-tiny").SerializeToString())


def test_the_graph_falls_into_two_towers_and_their_join() -> None:
    model = load_model(MODEL).model
    stamp_origins(model)
    cuts = {c.name: c for c in find_cuts(model)}
    assert list(cuts) == [*BRANCHES, "join"]
    assert cuts["image"].inputs == ("image",)
    assert cuts["text"].inputs == ("input_ids", "attention_mask")
    assert set(cuts["join"].inputs) == {*cuts["image"].outputs, *cuts["text"].outputs}
    assert sum(c.nodes for c in cuts.values()) == len(model.graph)
    single = load_model("zoo:resnet-tiny").model
    assert [c.name for c in find_cuts(single)] == ["join"]  # one input: nothing independent


def test_partitioned_outputs_match_the_unpartitioned_model(built, original) -> None:
    verification = built.manifest.verification
    assert verification.ok and verification.precision == "fp32"
    noise = {o.name: o.engine_noise for o in verification.outputs}
    with kiln.Session(built.path) as session:
        assert isinstance(session, PartitionedSession) and isinstance(session, SessionLike)
        for seed, batch in ((1, 1), (2, 3)):  # inputs other than the reference ones
            feeds = synthesize(session.interface, dims={"batch": batch}, seed=seed)
            got = session.run(None, feeds)
            want = original.run(None, feeds)
            for name, w, g in zip(session.output_names, want, got, strict=True):
                # the verify budget: fp32 tolerance of the output's scale, or the engines' noise
                check = check_output(name, w, g, FP32_TOLERANCE, noise[name])
                assert check.ok, check


def test_the_artifact_records_parts_crossings_and_provenance(built) -> None:
    whole, section, parts = read_partitioned(built.path)
    placed = {p.name: p.engine for p in section.parts}
    assert placed == {"image": "openvino", "text": "ort", "join": "ort"}
    share = max(cores() // len(BRANCHES), 1)
    assert {p.name: p.threads for p in section.parts} == {"image": share, "text": share,
                                                          "join": cores()}  # fmt: skip
    for spec in section.parts:  # each part a whole artifact, with its own engine and threads
        options = parts[spec.name].manifest.backend.options
        threads = options.get("intra_op_threads", options.get("inference_num_threads"))
        assert parts[spec.name].manifest.backend.name == spec.engine and threads == spec.threads
        assert parts[spec.name].manifest.verification.ok
        assert (built.path / spec.piece).is_file()
    crossing = {c["tensor"]: (c["from"], c["to"]) for c in section.crossings}
    join = next(p for p in section.parts if p.name == "join")
    assert set(crossing) == set(join.inputs)
    assert all(to == ["join"] for _, to in crossing.values())
    originals = {n.name for n in load_model(MODEL).model.graph}
    provenance = json.loads((built.path / "provenance.json").read_text())
    assert {key.split("/")[0] for key in provenance} == set(placed)
    assert all(set(e["origin"]) <= originals and e["origin"] for e in provenance.values())


def test_independent_parts_run_at_once(built) -> None:
    """Each tower, as it starts, waits for the other to have started: run one after the
    other, the first would wait in vain."""
    started = {name: threading.Event() for name in BRANCHES}
    saw_other: list[bool] = []

    def on_event(what: str, part: str) -> None:
        if what == "start" and part in started:
            started[part].set()
            saw_other.append(all(e.wait(timeout=20) for e in started.values()))

    with PartitionedSession(built.path, on_event=on_event) as session:
        session.run(None, synthesize(session.interface))
        events = session.events
    assert saw_other == [True, True]
    at = {(what, part): t for what, part, t, _ in events}
    threads = {part: thread for what, part, _, thread in events if what == "start"}
    assert threads["image"] != threads["text"]
    for a, b in (BRANCHES, BRANCHES[::-1]):  # the towers' runs overlap in time
        assert at[("start", a)] < at[("end", b)]
    assert at[("start", "join")] >= max(at[("end", b)] for b in BRANCHES)


def test_one_graph_verbs_name_the_parts_to_use(built, tmp_path) -> None:
    with pytest.raises(KilnError, match="partitioned artifact.*parts/image.kiln"):
        read_artifact(built.path)
    part = read_artifact(built.path / PARTS_DIR / "image.kiln")  # a part is an artifact
    assert part.manifest.source.path == str((built.path / "parts" / "image.onnx").absolute())
    with pytest.raises(KilnError, match="does not offer shape buckets"):
        kiln.Session(built.path, buckets="batch=1,4")
    with pytest.raises(KilnError, match="does not offer the feedback loop"):
        kiln.Session(built.path, feedback=True)


# ----------------------------------------------------------------------------- the CLI


def kiln_cli(args: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    """`kiln ARGS` in this process (the imports are paid once): exit code, stdout, stderr."""
    from kiln.cli import main

    monkeypatch.setattr(sys, "argv", ["kiln", *args])
    with pytest.raises(SystemExit) as stopped:
        main()
    out = capsys.readouterr()
    return int(stopped.value.code or 0), out.out, out.err


def _kserve_json(feeds: dict) -> str:
    from kiln.wire import datatype_of

    return json.dumps({"inputs": [
        {"name": k, "datatype": datatype_of(v), "shape": list(v.shape), "data": v.ravel().tolist()}
        for k, v in feeds.items()
    ]})  # fmt: skip


def test_kiln_serve_answers_for_a_partitioned_artifact(built, original) -> None:
    from fastapi.testclient import TestClient

    from kiln.serve.app import create_app

    session = kiln.Session(built.path)
    assert isinstance(session, PartitionedSession)
    feeds = [synthesize(load_model(MODEL).model, seed=seed) for seed in range(3)]
    with TestClient(create_app(session, "tt")) as client:
        for f in feeds:
            answer = client.post("/v2/models/tt/infer", content=_kserve_json(f))
            assert answer.status_code == 200, answer.text
            outputs = answer.json()["outputs"]
            got = {o["name"]: np.array(o["data"]).reshape(o["shape"]) for o in outputs}
            want = original.run(None, f)
            for name, value in zip([o.name for o in original.get_outputs()], want, strict=True):
                assert check_output(name, value, got[name].astype(value.dtype), FP32_TOLERANCE).ok
        runtime = client.get("/v2/models/tt/runtime").json()
        metrics = client.get("/metrics").text
        swap = client.post("/v2/models/tt/swap", content="{}")
    assert runtime["requests"] == len(feeds)
    assert set(runtime["parts"]) == {*BRANCHES, "join"}
    timed = [runtime["whole"], *runtime["parts"].values()]
    assert all(figures["runs"] == len(feeds) for figures in timed)
    assert runtime["whole"]["p50_ms"] >= runtime["parts"]["join"]["p50_ms"]
    assert 'kiln_queue_depth{model="tt"} 0.0' in metrics  # scraped with the others
    assert swap.status_code == 400 and "no shape buckets" in swap.text


def test_bench_times_a_partitioned_artifact_against_the_engines(
    built, tmp_path, monkeypatch, capsys
) -> None:
    out = tmp_path / "bench.json"
    args = ["bench", str(built.path), "--against", "ort", "--rounds", "1", "--runs", "3",
            "--no-memory", "-o", str(out)]  # fmt: skip
    code, _, err = kiln_cli(args, monkeypatch, capsys)
    assert code == 0, err
    report = json.loads(out.read_text())
    assert set(report["engines"]) >= {"ort", "kiln"}
    assert report["engines"]["kiln"]["cosine_vs_fp32"] > 0.9999  # its parts, run as a whole


def test_profile_covers_every_part_on_what_it_receives(built, tmp_path, monkeypatch, capsys):
    report = tmp_path / "profile.html"
    args = ["profile", str(built.path), "--runs", "2", "--rounds", "1", "--json", "-o", str(report)]
    code, out, _ = kiln_cli(args, monkeypatch, capsys)
    assert code == 0
    result = json.loads(out)
    assert list(result["parts"]) == ["image", "text", "join"]  # dependency order
    # The join receives the towers' embeddings, as computed by the parts before it.
    assert set(result["parts"]["join"]["inputs"]) == {"image_embeds", "text_embeds"}
    for name, part in result["parts"].items():
        assert part["nodes"], name  # its kernels mapped to the original nodes
        assert (tmp_path / f"profile-{name}.html").stat().st_size > 0
    assert result["end_to_end"]["runs"] == 2 and result["end_to_end"]["p50_ms"] > 0
    code, _, err = kiln_cli(["profile", str(built.path), "--backend", "ort"], monkeypatch, capsys)
    assert code == 2 and "drop --backend" in err


def test_compare_checks_every_part_against_its_piece(built, monkeypatch, capsys) -> None:
    code, out, _ = kiln_cli(["compare", MODEL, str(built.path), "--json"], monkeypatch, capsys)
    assert code == 0
    result = json.loads(out)
    assert list(result["parts"]) == ["image", "text", "join"]
    for name, part in result["parts"].items():
        piece = onnx.load(str(built.path / PARTS_DIR / f"{name}.onnx"))
        nodes = {node.name for node in piece.graph.node}
        compared = {row["node"] for row in part["layers"]}
        assert compared and compared <= nodes, name  # its own layers, not another part's
        assert part["b"]["spec"].endswith(f"{name}.kiln")
    assert result["first_divergence"] is None  # fp32 parts within Kiln's fp32 tolerance
    code, _, err = kiln_cli(["compare", str(built.path), MODEL], monkeypatch, capsys)
    assert code == 2 and "give it as B" in err


BAD = {
    "unknown part": (MODEL, "image=openvino,audio=ort",
                     "error: --partition: zoo:two-tower-tiny has no part 'audio'; its parts are "
                     "image, text, join."),
    "unknown engine": (MODEL, "image=tensorrt",
                       "error: --partition 'image=tensorrt': unknown engine 'tensorrt' for part "
                       "'image'; use one of ort, openvino."),
    "a chain": ("zoo:resnet-tiny", "image=ort",
                "error: --partition: zoo:resnet-tiny has no part 'image'; it is a chain of "
                "segments s00, s01_layer1.0, s02_layer2.0, s03_layer3.0, s04_layer4.0, s05 "
                "(name one, or its sNN)."),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_bad_placement_is_one_line_exit_2_nothing_written(
    case, tmp_path, monkeypatch, capsys
) -> None:
    model, placement, expected = BAD[case]
    monkeypatch.chdir(tmp_path)
    code, _, err = kiln_cli(["optimize", model, "-o", "out.kiln", "--partition", placement],
                            monkeypatch, capsys)  # fmt: skip
    assert code == 2 and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err
    assert " ".join(err.split()) == expected
    assert list(tmp_path.iterdir()) == []


def test_partition_auto_writes_an_artifact_and_says_why(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    args = ["optimize", MODEL, "-o", "tt.kiln", "--partition", "auto", "--rounds", "3",
            "--runs", "3", "--json"]  # fmt: skip
    code, out, err = kiln_cli(args, monkeypatch, capsys)
    assert code == 0, err
    summary = json.loads(out)
    record = summary["benchmark"]["partition"]
    engines = [e for e in available_backends() if e in ("ort", "openvino")]
    assert set(record["part_ms"]) == {*BRANCHES, "join"}
    assert all(set(times) == set(engines) for times in record["part_ms"].values())
    assert record["choice"] in ("partitioned", "single") and record["why"]
    assert record["predicted_ms"] > 0 and record["measured_ms"] > 0
    assert summary["benchmark"]["candidates"].keys() >= {f"{e}/fp32" for e in engines}
    path = tmp_path / "tt.kiln"
    assert summary["verification"]["ok"] and (path / "manifest.json").is_file()
    assert (summary["parts"] is not None) == (record["choice"] == "partitioned")
    with kiln.Session(path) as session:  # either way it opens and runs
        session.run(None, synthesize(session.interface))


def test_served_statistics_count_each_request_a_partitioned_artifact_runs(built) -> None:
    from kiln.serve.metrics import ServerMetrics, engine_runs

    session = kiln.Session(built.path)
    metrics = ServerMetrics(list).model("tt", "1")
    run = metrics.executions(session.run_batch, engine_runs(session))
    requests = [synthesize(load_model(MODEL).model, seed=seed) for seed in range(3)]
    assert len(run(requests)) == len(requests)  # handed over together, as a batcher does
    stats = metrics.statistics.to_json()
    # The parts run each request on its own: one execution each, as the session counts them.
    assert stats["execution_count"] == session.stats()["requests"] == len(requests)
    assert [b["compute_infer"]["count"] for b in stats["batch_stats"]] == [len(requests)]
