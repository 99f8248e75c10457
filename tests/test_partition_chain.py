"""Partitioned artifacts of a chain of layers (zoo:bert-tiny): cut where one tensor carries
everything on, each stretch placed on an engine, verified as a whole, reopened and served."""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from test_partition import kiln_cli

import kiln
from kiln import zoo
from kiln.artifact.parts import Pipeline
from kiln.backends import available_backends
from kiln.ir.inputs import synthesize
from kiln.partition import beats
from kiln.partition.chain import chain_cuts, place_chain
from kiln.partition.graph import find_cuts, pieces
from kiln.runtime.parts import PartitionedSession
from kiln.verify import FP32_TOLERANCE, check_output

MODEL = "zoo:bert-tiny"
NEEDS_OPENVINO = pytest.mark.skipif(
    "openvino" not in available_backends(), reason="OpenVINO is not installed"
)


def _bert() -> ir.Model:
    return ir.serde.deserialize_model(zoo.build("bert-tiny"))


def test_a_chain_falls_into_layers_and_the_mask_is_recomputed_not_handed_on() -> None:
    model = _bert()
    assert [c.name for c in find_cuts(model)] == ["join"]  # no branches: the mask is no part
    segments = chain_cuts(model)
    assert [s.name.split("_")[0] for s in segments] == ["s00", "s01", "s02", "s03", "s04"]
    crossing = {i for s in segments for i in s.inputs} - {"input_ids", "token_type_ids"}
    # One activation crosses each cut; the mask's readers take the model's attention_mask.
    assert all("mask" not in name for name in crossing - {"attention_mask"})
    assert all(len([i for i in s.inputs if i in crossing - {"attention_mask"}]) <= 1
               for s in segments)  # fmt: skip
    # The segments run in turn reproduce the whole model.
    split = pieces(model, segments)
    runners = {name: _runner(piece) for name, piece in split.items()}
    pipeline = Pipeline([_spec(s) for s in segments], runners,
                        ["input_ids", "attention_mask", "token_type_ids"])  # fmt: skip
    whole = ort.InferenceSession(zoo.build("bert-tiny").SerializeToString())
    feeds = synthesize(model, seed=3)
    feeds["attention_mask"][:, -2:] = 0  # padded: the recomputed mask must still apply
    values = pipeline.run(feeds)
    pipeline.close()
    for output, want in zip(whole.get_outputs(), whole.run(None, feeds), strict=True):
        np.testing.assert_allclose(values[output.name], want, rtol=1e-5, atol=1e-5)


def _runner(piece: ir.Model):
    session = ort.InferenceSession(ir.serde.serialize_model(piece).SerializeToString())
    return lambda feeds: session.run(None, feeds)


def _spec(cut):
    from kiln.artifact.parts import PartSpec

    return PartSpec(cut.name, "ort", "fp32", 1, cut.inputs, cut.outputs, cut.nodes)


def test_engines_switch_along_the_chain_only_where_the_gain_beats_the_handoff() -> None:
    segments = chain_cuts(_bert())
    fast = {"ort": 1.0, "openvino": 2.0}
    slow_ort = {"ort": 2.0, "openvino": 1.0}
    times = {s.name: (slow_ort if i in (1, 3) else fast) for i, s in enumerate(segments)}
    outputs = ["last_hidden_state", "pooler_output"]
    cheap = place_chain(segments, times, 0.1, outputs)
    assert cheap.engines == ["ort", "openvino", "ort", "openvino", "ort"]
    assert len(cheap.parts) == 5 and cheap.predicted_ms == pytest.approx(5.0 + 4 * 0.1)
    dear = place_chain(segments, times, 1.0, outputs)  # a hand-off costs what a switch wins
    assert dear.part_engines == ["ort"] and len(dear.parts) == 1
    (whole,) = dear.parts
    assert whole.inputs == ("input_ids", "attention_mask", "token_type_ids")
    assert set(whole.outputs) == set(outputs)


@NEEDS_OPENVINO
def test_a_chain_placed_by_hand_is_verified_written_and_served(tmp_path) -> None:
    built = kiln.compile(
        MODEL, tmp_path / "bt.kiln", partition="s01=openvino,s03=openvino", rounds=0
    )
    parts = built.manifest.parts["parts"]
    assert [p["engine"] for p in parts] == ["ort", "openvino", "ort", "openvino", "ort"]
    assert built.manifest.verification.ok
    noise = {o.name: o.engine_noise for o in built.manifest.verification.outputs}
    original = ort.InferenceSession(zoo.build("bert-tiny").SerializeToString())
    with kiln.Session(built.path) as session:
        assert isinstance(session, PartitionedSession)
        for seed, batch in ((1, 1), (2, 3)):
            feeds = synthesize(session.interface, dims={"batch": batch}, seed=seed)
            feeds["attention_mask"][0, -1] = 0
            for name, want, got in zip(session.output_names, original.run(None, feeds),
                                       session.run(None, feeds), strict=True):  # fmt: skip
                check = check_output(name, want, got, FP32_TOLERANCE, noise[name])
                assert check.ok, check


def test_partition_auto_times_every_segment_on_every_engine_and_says_why(
    tmp_path, monkeypatch, capsys
) -> None:
    monkeypatch.chdir(tmp_path)
    args = ["optimize", MODEL, "-o", "bt.kiln", "--partition", "auto", "--rounds", "2",
            "--runs", "3", "--json"]  # fmt: skip
    code, out, err = kiln_cli(args, monkeypatch, capsys)
    assert code == 0, err
    summary = json.loads(out)
    record = summary["benchmark"]["partition"]
    engines = {e for e in available_backends() if e in ("ort", "openvino")}
    assert [name.split("_")[0] for name in record["part_ms"]] == [f"s0{i}" for i in range(5)]
    assert all(set(times) == engines for times in record["part_ms"].values())
    assert record["choice"] in ("partitioned", "single") and record["why"]
    assert summary["verification"]["ok"]
    with kiln.Session(tmp_path / "bt.kiln") as session:
        session.run(None, synthesize(session.interface))


def test_a_segment_the_chain_does_not_have_is_one_line(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    code, _, err = kiln_cli(["optimize", MODEL, "-o", "bt.kiln", "--partition", "s09=ort"],
                            monkeypatch, capsys)  # fmt: skip
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "has no part 's09'; it is a chain of segments s00_" in " ".join(err.split())
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("partitioned_ms", "kept"),
    [
        ((90, 91, 92), True),  # faster in every round, by any margin
        ((99.5, 99, 99.8), True),
        ((90, 90, 101), True),  # 1.11× in the median, two rounds of three
        ((90, 101, 101), False),  # one round of three
        ((97, 97, 101), False),  # two of three, but 1.03×: within a spread of ±10 %
        ((90, 90), False),  # two rounds say nothing about the noise
        ((90, 90, 90, 101, 101), False),  # three of five is not two in three
        ((90, 90, 90, 90, 101), True),
    ],
)
def test_a_partitioned_build_is_kept_only_when_clearly_faster(
    partitioned_ms: tuple[float, ...], kept: bool
) -> None:
    single = [[0.100, 0.100] for _ in partitioned_ms]
    mine = [[ms / 1e3] * 2 for ms in partitioned_ms]
    assert beats(single, mine) is kept
