"""int8 under the accuracy guard: the hostile layer is found, kept in fp32, the budget holds."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto
from onnx import helper as h
from onnx import numpy_helper as nh

import kiln
from kiln.hardware import cpu_info


def hostile_model(path, outlier: float = 1000.0) -> None:
    """mm1 → a wide-range activation (one channel ×outlier, which mm2 ignores) → mm2 → mm3.

    Dynamic int8 quantizes mm2's input per tensor: the outlier channel takes the whole
    uint8 range and the channels mm2 really uses round to nothing. mm1 and mm3 are benign.
    """
    rng = np.random.default_rng(0)
    w1, w2, w3 = (rng.normal(0, 0.2, (64, 64)).astype(np.float32) for _ in range(3))
    w2[0, :] = 0.0
    scale = np.ones(64, np.float32)
    scale[0] = outlier
    nodes = [
        h.make_node("MatMul", ["x", "w1"], ["a"], name="mm1"),
        h.make_node("Mul", ["a", "scale"], ["wide"], name="outlier"),
        h.make_node("MatMul", ["wide", "w2"], ["b"], name="mm2"),
        h.make_node("MatMul", ["b", "w3"], ["y"], name="mm3"),
    ]
    inits = [nh.from_array(v, n) for v, n in ((w1, "w1"), (w2, "w2"), (w3, "w3"), (scale, "scale"))]
    graph = h.make_graph(
        nodes,
        "hostile",
        [h.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 64])],
        inits,
    )
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]), str(path))


def test_guard_restores_exactly_the_hostile_layer(tmp_path):
    hostile_model(tmp_path / "m.onnx")
    artifact = kiln.compile(tmp_path / "m.onnx", tmp_path / "m.kiln", precision="int8",
                            shapes={"x": (16, 64)}, rounds=0)  # fmt: skip
    manifest = artifact.manifest
    nodes = manifest.precision["nodes"]
    assert [n for n, p in nodes.items() if p.startswith("fp32")] == ["mm2"], nodes
    assert nodes["mm1"] == nodes["mm3"] == "int8"
    verification = manifest.verification
    assert verification.ok and verification.outputs[0].cosine >= 0.99
    ops = [n.op_type for n in onnx.load(str(artifact.model_path)).graph.node]
    assert ops.count("MatMulInteger") == 2 and ops.count("MatMul") == 1


def test_int8_without_verification_is_refused(tmp_path):
    with pytest.raises(kiln.KilnError, match="int8 is only written verified"):
        kiln.compile("zoo:bert-tiny", tmp_path / "b.kiln", precision="int8", verify=False, rounds=0)


def test_int8_transformer_is_quantized_and_traced(tmp_path):
    artifact = kiln.compile("zoo:bert-tiny", tmp_path / "b.kiln", precision="int8", rounds=0)
    assert artifact.manifest.verification.ok
    ops = {record["op_type"].split("::")[-1] for record in artifact.provenance().values()}
    assert {"MatMulInteger", "QAttention"} <= ops
    assert all(record["origin"] for record in artifact.provenance().values())


def test_conv_model_gets_static_qdq_int8_and_a_calibration_warning(tmp_path):
    import collections

    artifact = kiln.compile("zoo:resnet-tiny", tmp_path / "r.kiln", precision="int8", rounds=0)
    precision = artifact.manifest.precision
    assert precision["scheme"].startswith("static QDQ")
    assert precision["calibration"]["source"] == "synthetic"
    assert "unproven" in precision["calibration"]["warning"]
    assert artifact.manifest.verification.ok
    ops = collections.Counter(n.op_type for n in onnx.load(str(artifact.model_path)).graph.node)
    assert ops["QuantizeLinear"] > 0 and ops["DequantizeLinear"] > 0 and ops["FusedConv"] == 0


def test_static_int8_calibrates_on_the_users_inputs(tmp_path):
    x = np.random.default_rng(1).random((2, 3, 32, 32), dtype=np.float32)
    np.savez(tmp_path / "calib.npz", input=x)
    artifact = kiln.compile(
        "zoo:resnet-tiny",
        tmp_path / "r.kiln",
        precision="int8",
        inputs=str(tmp_path / "calib.npz"),
        rounds=0,
    )
    calibration = artifact.manifest.precision["calibration"]
    assert calibration["source"] == str(tmp_path / "calib.npz")
    assert "give separate samples with --calib" in calibration["warning"]


def test_calib_samples_calibrate_and_a_quarter_is_held_out(tmp_path):
    x = np.random.default_rng(1).random((8, 1, 3, 32, 32), dtype=np.float32)
    np.savez(tmp_path / "calib.npz", input=x)
    artifact = kiln.compile(
        "zoo:resnet-tiny",
        tmp_path / "r.kiln",
        precision="int8",
        calib=str(tmp_path / "calib.npz"),
        calib_method="percentile",
        rounds=0,
    )
    manifest = artifact.manifest
    narrow = ", 7-bit weights" if cpu_info().int8_dot_saturates else ""
    assert manifest.precision["scheme"] == f"static QDQ (percentile{narrow})"
    assert manifest.precision["calibration"]["held_out"] == 2
    assert "warning" not in manifest.precision["calibration"]
    assert manifest.verification.inputs == "held-out calibration samples"


def test_int8_that_needs_every_layer_in_fp32_is_refused(tmp_path):
    # One MatMul whose input has an outlier channel it ignores: no layer can stay int8.
    rng = np.random.default_rng(0)
    w = rng.normal(0, 0.2, (64, 64)).astype(np.float32)
    w[0, :] = 0.0
    scale = np.ones(64, np.float32)
    scale[0] = 1000.0
    nodes = [
        h.make_node("Mul", ["x", "scale"], ["wide"], name="outlier"),
        h.make_node("MatMul", ["wide", "w"], ["y"], name="mm"),
    ]
    graph = h.make_graph(
        nodes,
        "hopeless",
        [h.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 64])],
        [nh.from_array(w, "w"), nh.from_array(scale, "scale")],
    )
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]), str(tmp_path / "m.onnx"))
    with pytest.raises(kiln.KilnError, match="only with every layer kept in fp32"):
        kiln.compile(tmp_path / "m.onnx", tmp_path / "m.kiln", precision="int8",
                     shapes={"x": (16, 64)}, rounds=0)  # fmt: skip
    assert not (tmp_path / "m.kiln").exists()


def test_int4_guard_restores_exactly_the_hostile_weight(tmp_path):

    hostile_model(tmp_path / "m.onnx")
    model = onnx.load(str(tmp_path / "m.onnx"))
    arrays = {t.name: nh.to_array(t).copy() for t in model.graph.initializer}
    # mm2's odd rows are tiny and meet inputs 1000× larger: each row counts as much as the
    # others, but shares its 4-bit blocks with them and rounds to zero.
    arrays["w2"][1::2, :] *= 1e-3
    arrays["scale"][:] = 1.0
    arrays["scale"][1::2] = 1000.0
    for t in model.graph.initializer:
        t.CopyFrom(nh.from_array(arrays[t.name], t.name))
    onnx.save(model, str(tmp_path / "m.onnx"))
    # 4 bits cost a Gaussian 64×64 layer ≈ 10 % error: a 3 % budget lets mm1 and mm3 pass.
    artifact = kiln.compile(tmp_path / "m.onnx", tmp_path / "m.kiln", precision="int4",
                            shapes={"x": (16, 64)}, max_drop=0.03)  # fmt: skip
    nodes = artifact.manifest.precision["nodes"]
    assert [n for n, p in nodes.items() if p.startswith("fp32")] == ["mm2"], nodes
    assert artifact.manifest.verification.ok
    ops = [n.op_type for n in onnx.load(str(artifact.model_path)).graph.node]
    assert ops.count("MatMulNBits") == 2 and ops.count("MatMul") == 1


@pytest.mark.parametrize("model", ["zoo:bert-tiny", "zoo:resnet-tiny"])
def test_openvino_int8_through_nncf_is_verified(tmp_path, model):
    artifact = kiln.compile(
        model, tmp_path / "m.kiln", precision="int8", backend="openvino", rounds=0
    )
    manifest = artifact.manifest
    assert manifest.precision["scheme"] == "static QDQ (NNCF)"
    assert manifest.verification.ok and manifest.verification.score >= 0.99
    assert manifest.backend.name == "openvino"
    graph = onnx.load(str(artifact.model_path)).graph
    ops = [n.op_type for n in graph.node]
    assert "QuantizeLinear" in ops and "DequantizeLinear" in ops
    # Embedding tables are gathered as int8, never dequantized whole (OpenVINO would hold fp32).
    dequantized = {o for n in graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    assert not [n.name for n in graph.node if n.op_type == "Gather" and n.input[0] in dequantized]
    quantized = [n for n, p in manifest.precision["nodes"].items() if p == "int8"]
    assert quantized
    session = kiln.Session(artifact.path)  # runs on OpenVINO, as recorded
    assert session.executable.__class__.__name__ == "OpenVinoExecutable"


def test_int4_transformer_packs_matmul_weights(tmp_path):
    artifact = kiln.compile(
        "zoo:bert-tiny", tmp_path / "b.kiln", precision="int4",
        block_size=64, rounds=0,
    )  # fmt: skip
    manifest = artifact.manifest
    assert manifest.precision["scheme"] == "4-bit weights (MatMulNBits, block 64)"
    assert manifest.verification.ok and manifest.verification.score >= 0.99
    graph = onnx.load(str(artifact.model_path)).graph
    nbits = [n for n in graph.node if n.op_type == "MatMulNBits"]
    assert nbits and all(h.get_attribute_value(a) == 64 for n in nbits for a in n.attribute
                         if a.name == "block_size")  # fmt: skip


def test_budget_metrics_and_a_users_metric(tmp_path, monkeypatch):
    from kiln.verify import Budget, budget_for

    ref = [np.array([[0.1, 0.9, 0.0], [0.8, 0.1, 0.1]], np.float32)]
    flipped = [np.array([[0.1, 0.9, 0.0], [0.1, 0.8, 0.1]], np.float32)]
    assert Budget("top1").score(ref, flipped) == 0.5
    assert Budget("top1").threshold(ref) == pytest.approx(0.99)
    assert Budget("max-abs", 0.05).score(ref, [ref[0] + 0.04]) == pytest.approx(1 - 0.04 / 0.9)
    (tmp_path / "my_metric.py").write_text(
        "def agreement(ref, new):\n    return 10.0 - abs(float((ref[0] - new[0]).sum()))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    budget = budget_for("my_metric:agreement", max_drop=0.1)
    assert budget.threshold(ref) == pytest.approx(9.0)  # 10% below its score on fp32 itself
    assert budget.score(ref, [ref[0] + 0.1]) == pytest.approx(10 - 0.6, rel=1e-5)
    for bad, message in (
        ("nope", "unknown metric 'nope'"),
        ("no_such_module:f", "cannot be loaded"),
        ("my_metric:missing", "cannot be loaded"),
    ):
        with pytest.raises(kiln.KilnError, match=message):
            budget_for(bad)
    with pytest.raises(kiln.KilnError, match="--max-drop 2"):
        budget_for("cosine", 2)


def test_user_metric_decides_the_int8_guard(tmp_path, monkeypatch):
    # A metric that only accepts exact outputs: no layer may stay int8, so int8 is refused.
    (tmp_path / "strict.py").write_text(
        "import numpy as np\n"
        "def exact(ref, new):\n    return float(np.array_equal(ref[0], new[0]))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    hostile_model(tmp_path / "m.onnx")
    with pytest.raises(kiln.KilnError, match="only with every layer kept in fp32"):
        kiln.compile(tmp_path / "m.onnx", tmp_path / "m.kiln", precision="int8",
                     shapes={"x": (16, 64)}, metric="strict:exact", rounds=0)  # fmt: skip


def test_a_metric_scoring_0_on_fp32_takes_max_drop_on_its_own_scale(tmp_path, monkeypatch):
    # -max error scores 0 on fp32 itself; a relative drop of 0 would allow nothing at all.
    (tmp_path / "error_metric.py").write_text(
        "import numpy as np\n"
        "def neg_max_error(ref, new):\n"
        "    return -float(np.abs(ref[0] - new[0]).max())\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    from kiln.verify import budget_for

    budget = budget_for("error_metric:neg_max_error", max_drop=0.5)
    ref = [np.array([[0.1, 0.9]], np.float32)]
    assert budget.threshold(ref) == pytest.approx(-0.5)
    hostile_model(tmp_path / "m.onnx")
    artifact = kiln.compile(tmp_path / "m.onnx", tmp_path / "m.kiln", precision="int8",
                            shapes={"x": (16, 64)}, metric="error_metric:neg_max_error",
                            max_drop=0.5, rounds=0)  # fmt: skip
    verification = artifact.manifest.verification
    assert verification.ok and verification.threshold == pytest.approx(-0.5)
    assert "scores 0 on error_metric:neg_max_error" in verification.note


@pytest.mark.parametrize(
    "body, message",
    [
        ("    raise ValueError('shapes differ')\n", "raised ValueError: shapes differ"),
        ("    return None\n", "returned NoneType, not a number"),
    ],
)
def test_a_metric_that_fails_is_one_line_naming_it(tmp_path, monkeypatch, body, message):
    module = f"broken_metric_{len(body)}"  # one module per case: imports are cached
    (tmp_path / f"{module}.py").write_text("def score(ref, new):\n" + body)
    monkeypatch.syspath_prepend(str(tmp_path))
    hostile_model(tmp_path / "m.onnx")
    with pytest.raises(kiln.KilnError, match=f"metric '{module}:score' {message}"):
        kiln.compile(tmp_path / "m.onnx", tmp_path / "m.kiln", precision="int8",
                     shapes={"x": (16, 64)}, metric=f"{module}:score", rounds=0)  # fmt: skip
    assert not (tmp_path / "m.kiln").exists()


def _sequence_model() -> ir.Model:
    """x[batch, seq, 64] → MatMul → Relu → MatMul: every activation grows with seq."""
    rng = np.random.default_rng(0)
    weights = [rng.normal(0, 0.1, (64, 64)).astype(np.float32) for _ in range(2)]
    nodes = [
        h.make_node("MatMul", ["x", "w0"], ["a"], name="mm0"),
        h.make_node("Relu", ["a"], ["r"], name="relu"),
        h.make_node("MatMul", ["r", "w1"], ["y"], name="mm1"),
    ]
    graph = h.make_graph(
        nodes, "seq",
        [h.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", "seq", 64])],
        [h.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", "seq", 64])],
        [nh.from_array(w, f"w{i}") for i, w in enumerate(weights)],
    )  # fmt: skip
    return ir.from_proto(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]))


@pytest.mark.parametrize("available_mib", [64, 10_000])
def test_synthetic_calibration_is_made_short_enough_for_the_memory(available_mib, monkeypatch):
    import types

    import psutil

    from kiln.ir.ladder import Guess
    from kiln.precision.calibration import calibration_for

    # The activations a, r, y hold 3 × seq × 64 × 4 B: 48 MiB at seq 65,536. A quarter of
    # 64 MiB available is 16 MiB: halved twice, to seq 16,384 (12 MiB).
    memory = types.SimpleNamespace(available=available_mib * 2**20, total=2**34)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: memory)
    fit = Guess({"x": (1, 65_536, 64)})
    calibration = calibration_for(_sequence_model(), True, None, "minmax", None, None, fit)
    shapes = {s["x"].shape for s in calibration.samples}
    note = calibration.note.get("shortened", "")
    if available_mib == 64:
        assert shapes == {(1, 16_384, 64)}
        assert "seq=16384 (not seq=65536)" in note and "verified at seq=65536" in note
    else:
        assert shapes == {(1, 65_536, 64)} and not note
