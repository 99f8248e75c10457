"""The OpenVINO backend behind the Backend contract, checked against ONNX Runtime."""

from __future__ import annotations

import collections
import subprocess
import sys

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

ov = pytest.importorskip("openvino")

from kiln import zoo  # noqa: E402
from kiln.backends import get_backend  # noqa: E402
from kiln.backends.base import KernelRecord, Profile  # noqa: E402
from kiln.backends.openvino import OpenVinoBackend, OpenVinoOptions  # noqa: E402
from kiln.backends.ort import OrtOptions  # noqa: E402
from kiln.errors import KilnError  # noqa: E402
from kiln.ir.inputs import synthesize  # noqa: E402

TINY = [n for n in zoo.names() if zoo.entry(n).tiny]
HAS_BF16 = "BF16" in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
F32 = OpenVinoOptions(inference_precision="f32")


@pytest.fixture(scope="module")
def tiny() -> dict[str, tuple[ir.Model, dict[str, np.ndarray], list[np.ndarray]]]:
    """Each tiny zoo model, its synthesised inputs and ONNX Runtime's fp32 outputs."""
    out = {}
    ort = get_backend("ort")
    for name in TINY:
        model = ir.serde.deserialize_model(zoo.build(name))
        feeds = synthesize(model)
        out[name] = (model, feeds, ort.compile(model, OrtOptions(optimization="basic")).run(feeds))
    return out


def _assert_close(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        scale = float(np.abs(w).max()) if w.size else 0.0
        np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-4 * scale)


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    denom = np.linalg.norm(a) * np.linalg.norm(b)
    return float(a @ b / denom) if denom else float(np.array_equal(a, b))


def test_available_and_described():
    backend = OpenVinoBackend()
    assert backend.available()
    info = backend.describe()
    assert info["engine"] == "openvino" and info["version"] and "CPU" in info["devices"]


@pytest.mark.parametrize("name", TINY)
def test_f32_matches_onnx_runtime(tiny, name):
    model, feeds, want = tiny[name]
    exe = OpenVinoBackend().compile(model, F32)
    assert exe.precision == "f32"  # read back from the compiled model, not the request
    assert exe.output_names == [v.name for v in model.graph.outputs]
    _assert_close(exe.run(feeds), want)


@pytest.mark.skipif(not HAS_BF16, reason="this CPU has no bf16 support in OpenVINO")
@pytest.mark.parametrize("name", TINY)
def test_bf16_stays_close_to_fp32(tiny, name):
    model, feeds, want = tiny[name]
    exe = OpenVinoBackend().compile(model, OpenVinoOptions(inference_precision="bf16"))
    assert exe.precision == "bf16"
    for got, ref in zip(exe.run(feeds), want, strict=True):
        assert got.dtype == ref.dtype  # bf16 inside, the model's own types outside
        assert _cosine(got, ref) >= 0.99


def test_dynamic_batch_runs_on_one_executable(tiny):
    model, feeds, _ = tiny["bert-tiny"]
    exe = OpenVinoBackend().compile(model, F32)
    exe.run(feeds)  # batch 1 first: the same request must take a new shape afterwards
    feeds2 = synthesize(model, {"batch": 2})
    want = get_backend("ort").compile(model, OrtOptions(optimization="basic")).run(feeds2)
    got = exe.run(feeds2)
    assert got[0].shape[0] == 2
    _assert_close(got, want)


def test_concurrent_runs_from_threads_each_get_their_own_answer(tiny):
    # As an ONNX Runtime session, an executable takes runs from several threads at once (a
    # pipeline's streams, a server's workers): each at its own batch size, each answered right.
    from concurrent.futures import ThreadPoolExecutor

    model, _, _ = tiny["bert-tiny"]
    exe = OpenVinoBackend().compile(model, F32)
    ort = get_backend("ort").compile(model, OrtOptions(optimization="basic"))
    feeds = [synthesize(model, {"batch": 1 + i % 4}, seed=i) for i in range(16)]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(exe.run, feeds))
    for g, f in zip(got, feeds, strict=True):
        _assert_close(g, ort.run(f))


def test_outputs_come_in_the_order_asked(tiny):
    model, feeds, want = tiny["bert-tiny"]
    exe = OpenVinoBackend().compile(model, F32)
    names = exe.output_names[::-1]
    _assert_close(exe.run(feeds, names), want[::-1])
    # Outputs are copies: the next run must not overwrite what the caller holds.
    first = exe.run(feeds)[0]
    kept = first.copy()
    exe.run(synthesize(model, seed=1))
    np.testing.assert_array_equal(first, kept)


def test_profile_gives_per_layer_records_for_each_run(tiny):
    model, feeds, _ = tiny["resnet-tiny"]
    exe = OpenVinoBackend().compile(model, F32)
    runs = 3
    profile = exe.profile(feeds, runs=runs)
    assert isinstance(profile, Profile) and profile.engine == "openvino"
    assert len(profile.run_ms) == runs and all(ms > 0 for ms in profile.run_ms)
    records = profile.records
    assert records and all(isinstance(r, KernelRecord) for r in records)
    per_run = collections.Counter(r.run for r in records)
    assert sorted(per_run) == list(range(runs))
    assert all(r.dur_us >= 0 and r.op_type and r.node and r.provider for r in records)
    assert all(r.origin is not None for r in records)
    # The fused layers lead back to the ONNX nodes: every convolution names the ones it ran.
    onnx_nodes = {n.name for n in model.graph}
    convolutions = [r for r in records if r.op_type == "Convolution"]
    assert convolutions and all(set(r.origin) & onnx_nodes for r in convolutions)
    assert str(exe.compiled.get_property("PERF_COUNT")) == "NO"  # runs stay unprofiled


def test_providers_name_the_device(tiny):
    model, _, _ = tiny["bert-tiny"]
    assert OpenVinoBackend().compile(model, F32).providers == ["OpenVINO:CPU"]


def _model(node: onnx.NodeProto, extra_opset: str | None = None) -> ir.Model:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    w = numpy_helper.from_array(np.ones((4, 5), np.float32), "w")
    opsets = [helper.make_opsetid("", 17)]
    if extra_opset:
        opsets.append(helper.make_opsetid(extra_opset, 1))
    graph = helper.make_graph([node], "g", [x], [y], [w])
    return ir.serde.deserialize_model(helper.make_model(graph, opset_imports=opsets))


def test_unsupported_op_is_one_clear_line():
    model = _model(helper.make_node("Mystery", ["x"], ["y"], domain="acme.ops"), "acme.ops")
    with pytest.raises(KilnError, match="no conversion rule for operation.* acme.ops.Mystery") as e:
        OpenVinoBackend().compile(model)
    assert "\n" not in str(e.value) and ".cpp" not in str(e.value)


def test_broken_model_names_the_node():
    model = _model(helper.make_node("MatMul", ["x", "w"], ["y"], name="proj"))
    with pytest.raises(KilnError, match="node 'proj' \\(MatMul\\): Incompatible MatMul") as e:
        OpenVinoBackend().compile(model)
    assert "\n" not in str(e.value)


def test_bad_feeds_are_refused_not_converted(tiny):
    model, feeds, _ = tiny["resnet-tiny"]
    exe = OpenVinoBackend().compile(model, F32)
    (name,) = exe.input_names
    with pytest.raises(KilnError, match="must be float32, got float64"):
        exe.run({name: feeds[name].astype(np.float64)})
    with pytest.raises(KilnError, match=f"missing input '{name}'"):
        exe.run({})
    with pytest.raises(KilnError, match="must have shape"):
        exe.run({name: feeds[name][:, :2]})
    with pytest.raises(KilnError, match="unknown output 'nope'"):
        exe.run(feeds, ["nope"])


def test_options_are_checked_applied_and_round_trip(tmp_path, tiny):
    with pytest.raises(KilnError, match="OpenVINO device 'TPU' is not available here"):
        OpenVinoBackend().compile(tiny["resnet-tiny"][0], OpenVinoOptions(device="TPU"))
    with pytest.raises(KilnError, match="unknown OpenVINO performance hint 'FAST'"):
        OpenVinoOptions(performance_hint="FAST").properties()
    with pytest.raises(KilnError, match="unknown OpenVINO inference precision 'f64'"):
        OpenVinoOptions(inference_precision="f64").properties()
    options = OpenVinoOptions(
        performance_hint="THROUGHPUT",
        inference_precision="f32",
        num_streams=1,
        inference_num_threads=1,
        cache_dir=str(tmp_path / "cache"),
    )
    assert OpenVinoOptions.from_json(options.to_json()) == options
    model, feeds, want = tiny["resnet-tiny"]
    exe = OpenVinoBackend().compile(model, options)
    settings = exe.settings()
    assert settings["performance_hint"] == "THROUGHPUT" and settings["precision"] == "f32"
    assert settings["num_streams"] == "1" and settings["inference_num_threads"] == "1"
    assert any((tmp_path / "cache").iterdir())  # the compiled model was cached
    _assert_close(exe.run(feeds), want)


def test_model_from_a_file_with_external_data(tmp_path, tiny):
    model, feeds, want = tiny["bert-tiny"]
    path = tmp_path / "m.onnx"
    ir.save(model, path, external_data="m.onnx.data")
    _assert_close(OpenVinoBackend().compile(str(path), F32).run(feeds), want)
    with pytest.raises(KilnError, match="not found"):
        OpenVinoBackend().compile(str(tmp_path / "missing.onnx"))


def test_module_imports_and_reports_unavailable_without_openvino():
    code = (
        "import sys; sys.modules['openvino'] = None\n"
        "from kiln.backends.openvino import OpenVinoBackend\n"
        "print(OpenVinoBackend().available())"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


@pytest.mark.skipif(not HAS_BF16, reason="this CPU has no bf16 support in OpenVINO")
def test_bf16_plan_names_the_layers_openvino_keeps_in_fp32(tmp_path):
    import kiln

    artifact = kiln.compile("zoo:bert-tiny", tmp_path / "b.kiln", backend="openvino",
                            precision="bf16", rounds=0)  # fmt: skip
    plan = artifact.manifest.precision
    assert plan["default"] == "bf16" and plan["nodes"]
    names = set(artifact.provenance())  # the artifact's own nodes
    for node, why in plan["nodes"].items():
        assert why.startswith("fp32 (kept by openvino: ") and node in names


def test_nncf_transformer_preset_quantizes_a_model_whose_head_reads_a_transposed_tied_weight():
    # gpt2's lm_head multiplies by Transpose(wte): NNCF's SmoothQuant failed on it.
    from kiln.backends.openvino_quant import quantize_nncf_int8

    model = ir.from_proto(zoo.build("gpt2-tiny"))
    tied = [
        n for n in model.graph
        if n.op_type == "MatMul" and (p := n.inputs[1].producer()) is not None
        and p.op_type == "Transpose" and p.inputs[0].is_initializer()
    ]  # fmt: skip
    assert tied, "gpt2-tiny no longer reads a transposed tied weight: the test proves nothing"
    samples = [synthesize(model, seed=s) for s in range(2)]
    quantized = quantize_nncf_int8(model, samples, transformer=True)
    assert any(n.op_type == "QuantizeLinear" for n in quantized.graph)
    assert any(n.op_type == "Transpose" for n in model.graph), "the caller's model was changed"
    want = get_backend("ort").compile(model, OrtOptions()).run(samples[0])[0]
    got = get_backend("openvino").compile(quantized, OpenVinoOptions()).run(samples[0])[0]
    cosine = float(want.ravel() @ got.ravel() / np.linalg.norm(want) / np.linalg.norm(got))
    assert cosine > 0.99


@pytest.mark.parametrize("zero_point", [True, False])
def test_an_int8_embedding_table_is_gathered_before_it_is_dequantized(zero_point):
    # OpenVINO folds DequantizeLinear(constant) into fp32: the table would be held 4× larger.
    from kiln.passes.int8_rows import Int8RowsPass

    rng = np.random.default_rng(0)
    table = rng.integers(-128, 127, size=(50, 8), dtype=np.int8)
    inits = [
        numpy_helper.from_array(table, "q"),
        numpy_helper.from_array(rng.random(50, dtype=np.float32) / 50, "s"),
    ]
    if zero_point:
        inits.append(numpy_helper.from_array(rng.integers(-5, 5, 50, dtype=np.int8), "zp"))
    graph = helper.make_graph(
        [
            helper.make_node("DequantizeLinear", ["q", "s"] + ["zp"] * zero_point, ["w"], axis=0),
            helper.make_node("Gather", ["w", "ids"], ["rows"]),
        ],
        "embedding",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 3])],
        [helper.make_tensor_value_info("rows", TensorProto.FLOAT, [2, 3, 8])],
        inits,
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"ids": np.array([[0, 7, 49], [3, 3, 12]], dtype=np.int64)}
    want = get_backend("ort").compile(ir.from_proto(proto), OrtOptions()).run(feeds)[0]
    result = Int8RowsPass()(ir.from_proto(proto))
    model = result.model
    assert result.modified
    assert "DequantizeLinear" not in {n.op_type for n in model.graph}
    assert [v.name for v in model.graph.outputs] == ["rows"]
    for engine, options in (("ort", OrtOptions()), ("openvino", OpenVinoOptions())):
        got = get_backend(engine).compile(model, options).run(feeds)[0]
        np.testing.assert_array_equal(got, want)


def _key_transpose_graph(extra_reader: bool) -> onnx.ModelProto:
    """Q · K^T as exporters write it: K^T by one Transpose(0, 2, 3, 1) of [b, s, h, d]."""
    nodes = [
        helper.make_node("Transpose", ["q"], ["qh"], perm=[0, 2, 1, 3]),
        helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 2, 3, 1], name="key.Transpose"),
        helper.make_node("MatMul", ["qh", "kt"], ["scores"]),
    ]
    outputs = [helper.make_tensor_value_info("scores", TensorProto.FLOAT, [1, 2, 5, 5])]
    if extra_reader:  # a reader other than a MatMul's second input keeps K^T as it is
        nodes.append(helper.make_node("Relu", ["kt"], ["kt_relu"]))
        outputs.append(helper.make_tensor_value_info("kt_relu", TensorProto.FLOAT, None))
    inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 5, 2, 4]) for n in "qk"]
    graph = helper.make_graph(nodes, "attention", inputs, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_key_transpose_is_split_so_the_engine_fuses_it_with_outputs_bit_identical():
    from kiln.passes.key_transpose import KeyTransposeSplitPass

    proto = _key_transpose_graph(extra_reader=False)
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal((1, 5, 2, 4)).astype(np.float32) for n in "qk"}
    want = get_backend("ort").compile(ir.from_proto(proto), OrtOptions()).run(feeds)[0]
    result = KeyTransposeSplitPass()(ir.from_proto(proto))
    assert result.modified
    perms = [tuple(n.attributes.get_ints("perm")) for n in result.model.graph
             if n.op_type == "Transpose"]  # fmt: skip
    assert (0, 2, 3, 1) not in perms and perms.count((0, 2, 1, 3)) == 2 and (0, 1, 3, 2) in perms
    for engine, options in (("ort", OrtOptions()), ("openvino", F32)):
        got = get_backend(engine).compile(result.model, options).run(feeds)[0]
        np.testing.assert_array_equal(got, want)
    untouched = KeyTransposeSplitPass()(ir.from_proto(_key_transpose_graph(extra_reader=True)))
    assert not untouched.modified


def test_openvino_int8_graphs_leave_no_unfused_key_transpose():
    # NNCF's int8 bert-base ran K^T as twelve reference-kernel transposes, 2 % of its time.
    from kiln.precision.quantizers import quantizer_for

    model = ir.from_proto(zoo.build("bert-tiny"))
    samples = [synthesize(model, seed=s) for s in range(2)]
    assert any(tuple(n.attributes.get_ints("perm", ())) == (0, 2, 3, 1) for n in model.graph)
    quantizer = quantizer_for(model, "int8", "openvino", samples, samples[0], "minmax", 32)
    quantized = quantizer.quantize(model, [])
    assert not any(
        n.op_type == "Transpose" and tuple(n.attributes.get_ints("perm")) == (0, 2, 3, 1)
        for n in quantized.graph
    )
    want = get_backend("ort").compile(model, OrtOptions()).run(samples[1])[0]
    got = get_backend("openvino").compile(quantized, OpenVinoOptions()).run(samples[1])[0]
    cosine = float(want.ravel() @ got.ravel() / np.linalg.norm(want) / np.linalg.norm(got))
    assert cosine > 0.99


def test_an_in_memory_int8_model_with_external_weights_compiles(tmp_path):
    # Compiled through a temporary file: OpenVINO read int8 weights of 1 MB and more from it
    # mid-compile, after the file was gone ("Cannot open file: /tmp/kiln-ov-…/model.onnx.data").
    from kiln.backends.openvino_quant import quantize_nncf_int8

    width, rng = 1024, np.random.default_rng(0)
    weight = (rng.standard_normal((width, width)) / width**0.5).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])],
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, width])],
        [numpy_helper.from_array(weight, "w")],
    )
    model = ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    samples = [{"x": rng.standard_normal((4, width)).astype(np.float32)} for _ in range(2)]
    path = tmp_path / "q.onnx"
    ir.save(quantize_nncf_int8(model, samples), path, external_data="q.data")
    want = OpenVinoBackend().compile(str(path)).run(samples[0])[0]
    lazy = ir.load(path)  # its weights still in q.data
    np.testing.assert_array_equal(OpenVinoBackend().compile(lazy).run(samples[0])[0], want)
