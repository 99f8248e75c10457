"""`kiln compare`: two versions of a model layer by layer, and the layer that broke."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import numpy_helper as nh
from test_precision import hostile_model  # a model with one layer int8 breaks

import kiln
from kiln.debug import compare
from kiln.debug.compare import _SKIPPED_OPS


def kiln_cli(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kiln", *args], cwd=cwd, capture_output=True, text=True
    )


def one_line_error(result: subprocess.CompletedProcess) -> str:
    """A refusal: exit 2, one line on stderr, no traceback."""
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def zoo_files(tmp_path_factory):
    """resnet-tiny and bert-tiny as .onnx files, as a user would have them."""
    where = tmp_path_factory.mktemp("zoo")
    for name in ("resnet-tiny", "bert-tiny"):
        result = kiln_cli("zoo", "export", name, "-o", f"{name}.onnx", cwd=where)
        assert result.returncode == 0, result.stderr
    return where


def perturbed_copy(source, target) -> str:
    """The model with one weight ×1.3: the middle Conv/MatMul's; returns that node's name."""
    model = onnx.load(str(source))
    weights = {t.name: t for t in model.graph.initializer}
    layers = [
        n
        for n in model.graph.node
        if n.op_type in ("Conv", "MatMul") and any(i in weights for i in n.input)
    ]
    node = layers[len(layers) // 2]
    weight = weights[next(i for i in node.input if i in weights)]
    weight.CopyFrom(nh.from_array(nh.to_array(weight) * np.float32(1.3), weight.name))
    onnx.save(model, str(target))
    return node.name


def compared_nodes(path) -> set[str]:
    """The original nodes a comparison of this model with itself has a row for."""
    graph = onnx.load(str(path)).graph
    return {n.name for n in graph.node if n.op_type not in _SKIPPED_OPS}


@pytest.mark.parametrize("name", ["resnet-tiny", "bert-tiny"])
def test_a_model_against_itself_has_no_divergence_and_every_row_is_exact(zoo_files, name):
    path = str(zoo_files / f"{name}.onnx")
    result = compare(path, path).to_json()
    assert result["first_divergence"] is None
    assert all(row["exact"] and row["ok"] for row in result["layers"])
    # Every float-valued layer has its row (integer shape bookkeeping has none).
    nodes = {row["node"] for row in result["layers"]}
    assert nodes <= compared_nodes(path)
    if name == "resnet-tiny":  # every layer computes floats
        assert nodes == compared_nodes(path)
    assert [row["index"] for row in result["layers"]] == list(range(len(result["layers"])))


@pytest.mark.parametrize("name", ["resnet-tiny", "bert-tiny"])
def test_a_perturbed_weight_is_found_at_the_node_that_consumes_it(zoo_files, tmp_path, name):
    bad = tmp_path / "bad.onnx"
    planted = perturbed_copy(zoo_files / f"{name}.onnx", bad)
    result = compare(str(zoo_files / f"{name}.onnx"), str(bad)).to_json()
    assert result["first_divergence"] == planted
    rows = result["layers"]
    first = result["first_divergence_row"]
    assert all(row["exact"] for row in rows[: first["index"]])  # before it: untouched
    assert not first["ok"] and first["max_abs"] > 0
    assert result["budget"]["metric"] == "max-abs"  # fp32 against fp32


def test_a_hostile_layer_forced_into_int8_is_named(tmp_path):
    # An outlier mild enough that int8 mm2 keeps some signal (cosine ~0.8, where ×1000
    # leaves none), so a budget this loose keeps every layer in int8, mm2 included.
    hostile_model(tmp_path / "m.onnx", outlier=300.0)
    shapes = {"x": (16, 64)}
    artifact = kiln.compile(tmp_path / "m.onnx", tmp_path / "m.kiln", precision="int8",
                            shapes=shapes, max_drop=0.99, rounds=0)  # fmt: skip
    assert set(artifact.manifest.precision["nodes"].values()) == {"int8"}
    result = compare(str(tmp_path / "m.onnx"), str(artifact.path), shapes=shapes).to_json()
    assert result["first_divergence"] == "mm2"
    rows = {row["node"]: row for row in result["layers"]}
    assert rows["mm1"]["ok"] and rows["mm1"]["b"]["precision"] == "int8"  # benign int8
    assert rows["mm2"]["b"]["precision"] == "int8"
    assert "quantize-int8" in rows["mm2"]["b"]["passes"]
    assert result["budget"]["metric"] == "cosine"


def cancelling_model(path, offset: float = 40.0) -> None:
    """shift (+offset) → mm1 → cancel (− what the offset alone gives): mm1's output is mostly
    the offset's share, so int8 mm1 keeps its cosine while cancel, exact in fp32, leaves its
    rounding error and little of the signal."""
    from onnx import TensorProto
    from onnx import helper as h

    w1 = np.random.default_rng(0).normal(0, 0.2, (64, 64)).astype(np.float32)
    shift = np.full(64, offset, np.float32)
    nodes = [
        h.make_node("Add", ["x", "shift"], ["shifted"], name="shift"),
        h.make_node("MatMul", ["shifted", "w1"], ["a"], name="mm1"),
        h.make_node("Sub", ["a", "common"], ["y"], name="cancel"),
    ]
    inits = [nh.from_array(w1, "w1"), nh.from_array(shift, "shift"),
             nh.from_array(shift @ w1, "common")]  # fmt: skip
    x = h.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])
    y = h.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 64])
    graph = h.make_graph(nodes, "cancelling", [x], [y], inits)
    onnx.save(h.make_model(graph, opset_imports=[h.make_opsetid("", 17)]), str(path))


def test_an_fp32_layer_carrying_int8_error_past_the_budget_blames_the_int8_layer(tmp_path):
    cancelling_model(tmp_path / "m.onnx")
    calib = np.random.default_rng(1).normal(0, 1, (8, 16, 64)).astype(np.float32)
    np.savez(tmp_path / "calib.npz", x=calib)
    built = kiln_cli("optimize", "m.onnx", "--precision", "int8", "--calib", "calib.npz",
                     "--max-drop", "0.99", "--rounds", "0", "-o", "m.kiln", "--shape", "x=16x64",
                     cwd=tmp_path)  # fmt: skip
    assert built.returncode == 0, built.stderr
    result = kiln_cli("compare", "m.onnx", "m.kiln", "--shape", "x=16x64", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    rows = {row["node"]: row for row in data["layers"]}
    # the budget breaks at cancel, which runs in fp32 on both sides and only carries error
    assert not rows["cancel"]["ok"] and rows["cancel"]["b"]["precision"] == "fp32"
    assert rows["mm1"]["ok"] and rows["mm1"]["b"]["precision"] == "int8"
    assert data["first_divergence"] == "mm1"
    assert data["first_divergence_row"]["shows_at"]["node"] == "cancel"
    from kiln.report.compare import headline

    said = headline(data)
    assert said.startswith("first divergence: mm1") and "cancel" in said


def test_a_compiled_side_keeps_its_fusions_and_no_insides_are_invented():
    result = compare("zoo:bert-tiny", "zoo:bert-tiny@ort:int8").to_json()
    assert result["b"]["precision"] == "int8" and result["first_divergence"] is None
    rows = result["layers"]
    fused = [r for r in rows if r["b"]["op_type"] == "com.microsoft::QAttention"]
    assert fused, "the fused attention's output is compared"
    # What the fused kernels swallowed has no row: Softmax lives inside (Q)Attention.
    assert not [r for r in rows if r["op_type"] == "Softmax"]
    assert all(r["b"]["origin"] for r in rows)
    matmuls = [r for r in rows if r["op_type"] == "MatMul"]
    assert matmuls and all(r["b"]["precision"] == "int8" for r in matmuls)


def test_every_int8_row_names_its_quantization_and_the_footer_counts_every_row():
    from rich.console import Console

    from kiln.report.compare import print_compare

    result = compare("zoo:resnet-tiny", "zoo:resnet-tiny@ort:int8").to_json()
    rows = result["layers"]
    int8 = [r for r in rows if r["b"]["precision"] == "int8"]
    assert len(int8) > 1  # its Convs (each folded with its BatchNorm) and its Gemm
    assert all("quantize-int8" in r["b"]["passes"] for r in int8), [
        (r["node"], r["b"]["passes"]) for r in int8
    ]
    console = Console(record=True, width=240)
    print_compare(result, console)
    outputs = sum(r["output"] for r in rows)
    said = f"{len(rows)} tensors compared ({len(rows) - outputs} intermediate, {outputs} output"
    assert said in console.export_text()


def test_onnx_runtime_and_openvino_agree_within_fp32_tolerance():
    result = compare("zoo:resnet-tiny", "zoo:resnet-tiny@openvino:fp32").to_json()
    assert result["b"]["engine"] == "openvino"
    assert result["budget"]["metric"] == "max-abs"
    assert result["first_divergence"] is None, result["first_divergence_row"]
    assert result["shared_tensors"] > 0


def test_graphs_that_share_nothing_compare_their_outputs_only(zoo_files, tmp_path):
    model = onnx.load(str(zoo_files / "resnet-tiny.onnx"))
    outputs = {o.name for o in model.graph.output}
    renamed = {}
    for node in model.graph.node:  # a re-export: every node and intermediate tensor renamed
        node.name = f"x_{node.name}"
        node.input[:] = [renamed.get(i, i) for i in node.input]
        for index, name in enumerate(node.output):
            if name not in outputs:
                renamed[name] = node.output[index] = f"x_{name}"
    onnx.save(model, str(tmp_path / "renamed.onnx"))
    result = compare(str(zoo_files / "resnet-tiny.onnx"), str(tmp_path / "renamed.onnx"))
    data = result.to_json()
    assert any("share no intermediate tensors" in note for note in data["notes"])
    assert [row["tensor"] for row in data["layers"]] == sorted(outputs)
    assert data["first_divergence"] is None and data["layers"][0]["exact"]


def test_unrelated_models_sharing_node_names_compare_their_outputs_only():
    # both name their pooling node `avgpool`; its tensors are [1, 64, 1, 1] and [1, 256, 1, 1]
    data = compare("zoo:resnet-tiny", "zoo:mobilenetv2-tiny").to_json()
    assert not data["related"] and data["first_divergence"] is None
    assert all(row["output"] for row in data["layers"]) and data["shared_tensors"] == 0
    note = next(n for n in data["notes"] if "not two versions of one model" in n)
    assert "avgpool: shape" in note and "only the outputs are compared" in note
    from kiln.report.compare import headline

    assert "while its inputs agree" not in headline(data)


def test_cli_json_html_and_model_explorer(zoo_files, tmp_path):
    bad = tmp_path / "bad.onnx"
    planted = perturbed_copy(zoo_files / "resnet-tiny.onnx", bad)
    result = kiln_cli("compare", str(zoo_files / "resnet-tiny.onnx"), str(bad), "--json",
                      "-o", "report.html", "--model-explorer", "me", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    assert data["first_divergence"] == planted
    assert {"node", "max_abs", "max_rel", "cosine", "a", "b"} <= set(data["layers"][0])
    assert planted in (tmp_path / "report.html").read_text()
    error = json.loads((tmp_path / "me" / "error.json").read_text())
    (graph,) = error
    assert error[graph]["results"][planted]["value"] > 0
    latency = json.loads((tmp_path / "me" / "latency.json").read_text())
    assert sum(r["value"] for r in latency[graph]["results"].values()) > 0


def test_cli_table_names_the_first_divergence(zoo_files, tmp_path):
    bad = tmp_path / "bad.onnx"
    planted = perturbed_copy(zoo_files / "resnet-tiny.onnx", bad)
    result = kiln_cli("compare", str(zoo_files / "resnet-tiny.onnx"), str(bad), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"first divergence: {planted}" in " ".join(result.stdout.split())


def test_inputs_of_the_wrong_shape_are_one_line(zoo_files, tmp_path):
    np.savez(tmp_path / "x.npz", input=np.zeros((1, 3, 16, 16), np.float32))  # 32×32 expected
    model = str(zoo_files / "resnet-tiny.onnx")
    line = one_line_error(kiln_cli("compare", model, model, "--inputs", "x.npz", cwd=tmp_path))
    assert "input 'input' has shape [1, 3, 16, 16]" in line


def test_an_artifact_whose_original_is_gone_is_one_line(zoo_files, tmp_path):
    shutil.copy(zoo_files / "resnet-tiny.onnx", tmp_path / "m.onnx")
    kiln.compile(tmp_path / "m.onnx", tmp_path / "a.kiln", rounds=0)
    shutil.copytree(tmp_path / "a.kiln", tmp_path / "b.kiln")
    (tmp_path / "m.onnx").unlink()
    line = one_line_error(kiln_cli("compare", "a.kiln", "b.kiln", cwd=tmp_path))
    assert "m.onnx, which is gone" in line


def test_models_with_other_inputs_are_one_line(tmp_path):
    line = one_line_error(kiln_cli("compare", "zoo:bert-tiny", "zoo:resnet-tiny", cwd=tmp_path))
    assert "takes inputs" in line


def test_bf16_without_bf16_kernels_is_refused_in_one_line(tmp_path):
    from kiln.backends.openvino import cpu_runs_bf16

    if cpu_runs_bf16():
        pytest.skip("this CPU has bf16 kernels")
    result = kiln_cli("compare", "zoo:bert-tiny", "zoo:bert-tiny@openvino:bf16", cwd=tmp_path)
    assert "no bf16 kernels" in one_line_error(result)


@pytest.mark.parametrize("drift", ["outputs", "everything"])
def test_an_engine_that_computes_otherwise_when_exposed_is_said_and_checked(
    zoo_files, tmp_path, monkeypatch, drift
):
    """An engine may compile the exposed graph into another program (OpenVINO's int8 does):
    the comparison says so, and re-measures the first divergence with few tensors exposed."""
    import importlib

    module = importlib.import_module("kiln.debug.compare")  # the module, not the function
    bad = tmp_path / "bad.onnx"
    planted = perturbed_copy(zoo_files / "resnet-tiny.onnx", bad)
    honest = module.run_exposed

    def drifting(side, names, feeds):  # with many tensors exposed, B computes otherwise
        ran = honest(side, names, feeds)
        if side.spec != str(bad) or len(names) <= 5:
            return ran
        moved = {"logits"} if drift == "outputs" else set(ran)
        return {k: v + np.float32(0.5) if k in moved else v for k, v in ran.items()}

    monkeypatch.setattr(module, "run_exposed", drifting)
    result = compare(str(zoo_files / "resnet-tiny.onnx"), str(bad)).to_json()
    notes = " ".join(result["notes"])
    assert f"changed {bad}'s own outputs" in notes
    if drift == "outputs":  # the layers still tell the truth: the planted one stands
        assert f"first divergence {planted} confirmed" in notes
    else:  # every exposed tensor moved: the first row out of budget does not stand alone
        assert f"first divergence {result['first_divergence']} not confirmed" in notes
        assert result["first_divergence"] != planted
