"""The memory plan: tensor lifetimes, the live peak, the greedy-by-size arena, in `kiln profile`."""

from __future__ import annotations

import json

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper
from rich.console import Console
from typer.testing import CliRunner

from kiln import zoo
from kiln.cost.memory_plan import TensorLife, greedy_by_size, plan_memory
from kiln.hardware import Peaks
from kiln.report import print_profile

PEAKS = Peaks(100.0, 200.0, 400.0, 20.0, 2, "test")
FLOAT = 4  # bytes per float32
WIDTHS = {"x": 16, "A": 32, "B": 64, "C": 32, "D": 32}  # chain x→A→B→C, D = C + A


def _model(nodes, inputs, outputs, initializers=(), opsets=(("", 17),)) -> ir.Model:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    return ir.from_proto(proto)


def _f32(name: str, *shape: int) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, list(shape))


def _weight(name: str, rows: int, cols: int) -> onnx.TensorProto:
    return numpy_helper.from_array(np.zeros((rows, cols), np.float32), name)


@pytest.fixture(scope="module")
def skip_chain() -> ir.Model:
    """x →MatMul→ A →MatMul→ B →MatMul→ C, then D = C + A: A is held across the chain."""
    w = WIDTHS
    return _model(
        [
            helper.make_node("MatMul", ["x", "W0"], ["A"], name="n0"),
            helper.make_node("MatMul", ["A", "W1"], ["B"], name="n1"),
            helper.make_node("MatMul", ["B", "W2"], ["C"], name="n2"),
            helper.make_node("Add", ["C", "A"], ["D"], name="n3"),
        ],
        [_f32("x", 1, w["x"])],
        [_f32("D", 1, w["D"])],
        [_weight("W0", w["x"], w["A"]), _weight("W1", w["A"], w["B"]),
         _weight("W2", w["B"], w["C"])],
    )  # fmt: skip


def test_lifetimes_and_the_live_peak_of_a_skip_connection(skip_chain):
    plan = plan_memory(skip_chain)
    size = {name: FLOAT * width for name, width in WIDTHS.items()}
    lives = {t.name: (t.first, t.last, t.bytes) for t in plan.tensors}
    # A is read by n1 and again by n3; D is a graph output, alive to the last node.
    assert lives == {
        "A": (0, 3, size["A"]),
        "B": (1, 2, size["B"]),
        "C": (2, 3, size["C"]),
        "D": (3, 3, size["D"]),
    }
    # While a node runs its inputs and outputs are both held.
    assert plan.live_bytes == (
        size["A"],
        size["A"] + size["B"],
        size["A"] + size["B"] + size["C"],
        size["A"] + size["C"] + size["D"],
    )
    assert plan.live_peak_bytes == size["A"] + size["B"] + size["C"]
    assert plan.peak_step == 2 and plan.nodes[plan.peak_step] == "n2"
    assert [t.name for t in plan.at_peak] == ["B", "A", "C"]  # largest first, then by birth
    assert [t.producer for t in plan.at_peak] == ["n1", "n0", "n2"]
    # weights and the input are held apart from the activations
    w = WIDTHS
    weights = FLOAT * (w["x"] * w["A"] + w["A"] * w["B"] + w["B"] * w["C"])
    assert plan.weights_bytes == weights and plan.inputs_bytes == size["x"]
    assert plan.no_reuse_bytes == size["A"] + size["B"] + size["C"] + size["D"]
    assert plan.unknown == () and plan.control_flow == 0


def test_greedy_by_size_reaches_the_peak_where_the_hand_plan_does(skip_chain):
    plan = plan_memory(skip_chain)
    offsets = {t.name: o for t, o in zip(plan.tensors, plan.offsets, strict=True)}
    # By hand: B (largest) at 0; A overlaps B in time, above it; C overlaps both, above A;
    # D overlaps A and C but not B, so it reuses B's bytes at 0. Arena = A + B + C = the peak.
    size = {name: FLOAT * width for name, width in WIDTHS.items()}
    assert offsets == {"B": 0, "A": size["B"], "C": size["B"] + size["A"], "D": 0}
    assert plan.greedy_arena_bytes == plan.live_peak_bytes


def test_greedy_by_size_can_exceed_the_live_peak():
    """Largest first is a heuristic: here it fragments. In 64-byte units, A(3)@[0,0],
    C(3)@[0,1], D(1)@[1,3], B(3)@[3,3]: greedy puts A at 0, C at 3, B at 0 (alone in time
    with D, not yet placed), then D overlaps C (3..6) and B (0..3), so goes to 6: arena 7.
    The live peak is A + C = 6, and C@0, A@3, D@3, B@0 reaches it."""
    unit = 64
    spans = {"A": (3, 0, 0), "B": (3, 3, 3), "C": (3, 0, 1), "D": (1, 1, 3)}
    lives = [TensorLife(n, s * unit, a, b, f"make_{n}", "Op") for n, (s, a, b) in spans.items()]
    offsets, arena = greedy_by_size(lives, alignment=unit)
    assert dict(zip(spans, (o // unit for o in offsets), strict=True)) == {
        "A": 0, "B": 0, "C": 3, "D": 6
    }  # fmt: skip
    live_peak = max(sum(t.bytes for t in lives if t.alive_at(step)) for step in range(4))
    assert live_peak == 6 * unit and arena == 7 * unit


def test_sizes_are_aligned_in_the_arena_not_in_the_live_peak():
    lives = [TensorLife("a", 10, 0, 1, "p", "Op"), TensorLife("b", 10, 1, 1, "q", "Op")]
    offsets, arena = greedy_by_size(lives, alignment=64)
    assert offsets == [0, 64] and arena == 128
    assert greedy_by_size(lives, alignment=1) == ([0, 10], 20)


def test_outputs_live_to_the_end_and_unread_tensors_only_at_birth():
    model = _model(
        [
            helper.make_node("Relu", ["x"], ["Y"], name="first"),
            helper.make_node("Neg", ["x"], ["U"], name="unread"),
            helper.make_node("Relu", ["x"], ["Z"], name="last"),
        ],
        [_f32("x", 2, 8)],
        [_f32("Y", 2, 8), _f32("Z", 2, 8)],
    )
    plan = plan_memory(model)
    assert {t.name: (t.first, t.last) for t in plan.tensors} == {
        "Y": (0, 2), "U": (1, 1), "Z": (2, 2)
    }  # fmt: skip
    one = FLOAT * 2 * 8
    assert plan.live_bytes == (one, 2 * one, 2 * one)


def test_unknown_shapes_are_counted_as_unknown_not_guessed():
    model = _model(
        [
            helper.make_node("Relu", ["x"], ["known"], name="relu"),
            helper.make_node("Mystery", ["known"], ["m"], name="mystery", domain="test.custom"),
            helper.make_node("Relu", ["m"], ["r"], name="after"),
        ],
        [_f32("x", 4, 4)],
        [helper.make_tensor_value_info("r", TensorProto.FLOAT, None)],
        opsets=(("", 17), ("test.custom", 1)),
    )
    plan = plan_memory(model)
    assert plan.unknown == ("m", "r")
    assert [t.name for t in plan.tensors] == ["known"]
    assert plan.to_json()["unknown"] == 2


def test_a_tensor_a_control_flow_body_reads_stays_alive_until_that_node():
    then = helper.make_graph(
        [helper.make_node("Identity", ["A"], ["t"])], "then", [], [_f32("t", 1, 8)]
    )
    other = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["e"])], "else", [], [_f32("e", 1, 8)]
    )
    model = _model(
        [
            helper.make_node("Relu", ["x"], ["A"], name="a"),
            helper.make_node("Neg", ["x"], ["B"], name="b"),
            helper.make_node("If", ["cond"], ["out"], name="if", then_branch=then,
                             else_branch=other),
            helper.make_node("Add", ["out", "B"], ["y"], name="add"),
        ],
        [_f32("x", 1, 8), helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
        [_f32("y", 1, 8)],
    )  # fmt: skip
    plan = plan_memory(model)
    lives = {t.name: (t.first, t.last) for t in plan.tensors}
    assert lives["A"] == (0, 2)  # read inside the If's then-branch only
    assert lives["out"] == (2, 3)
    assert plan.control_flow == 1


def test_to_json_is_json_and_trims_the_peak_tensors(skip_chain):
    plan = plan_memory(skip_chain)
    data = json.loads(json.dumps(plan.to_json(top=2)))
    assert data["live_peak_bytes"] == plan.live_peak_bytes
    assert data["live_peak_mib"] == pytest.approx(plan.live_peak_bytes / 2**20)
    assert data["peak"]["tensors_alive"] == 3 and len(data["peak"]["tensors"]) == 2
    assert data["peak"]["node"] == "n2" and data["peak"]["tensors"][0]["producer"] == "n1"
    assert data["series"]["node"] == ["n0", "n1", "n2", "n3"]
    assert len(data["series"]["live_mib"]) == len(data["series"]["op_type"]) == 4


def test_kiln_profile_carries_the_memory_plan(monkeypatch, tmp_path):
    from kiln.cli import app

    monkeypatch.setattr("kiln.hardware.measured_peaks", lambda **_: PEAKS)
    html = tmp_path / "report.html"
    args = ["profile", "zoo:resnet-tiny", "--runs", "2", "--rounds", "1", "--json", "-o", html]
    out = CliRunner().invoke(app, [str(a) for a in args])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    plan = data["memory_plan"]
    assert plan["live_peak_mib"] > 0 and plan["unknown"] == 0
    assert plan["greedy_arena_mib"] >= plan["live_peak_mib"]
    assert plan["no_reuse_mib"] >= plan["greedy_arena_mib"]
    assert max(plan["series"]["live_mib"]) == pytest.approx(plan["live_peak_mib"], abs=1e-6)
    model = zoo.build("resnet-tiny")
    assert len(plan["series"]["node"]) == len(model.graph.node)
    weights = sum(numpy_helper.to_array(t).nbytes for t in model.graph.initializer)
    assert plan["weights_mib"] == pytest.approx(weights / 2**20)
    assert plan["measured_peak_mib"] == data["memory"]["first_run_growth_mib"]
    at_peak = plan["peak"]["tensors"]
    assert 0 < len(at_peak) <= 10 and plan["peak"]["node"] in plan["series"]["node"]
    assert [t["bytes"] for t in at_peak] == sorted((t["bytes"] for t in at_peak), reverse=True)
    page = html.read_text()
    assert "Memory plan" in page and 'id="memory-plan"' in page
    assert at_peak[0]["name"] in page
    console = Console(record=True, width=200)
    print_profile(data, console)
    assert "activation peak (plan)" in console.export_text()
