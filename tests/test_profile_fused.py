"""`kiln profile` of a small artifact whose passes fused Conv+Relu: each kernel leads to the
originals it ran, once, so the time per original adds up to the kernel time measured; and its
advice follows what building the artifact measured for the model over the machine's peaks."""

from __future__ import annotations

import json
import shutil
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.hardware import Peaks
from kiln.profile import profile_model
from kiln.profile.mapping import LAYOUT_OPS, NodeMatcher

PEAKS = Peaks(
    fp32_gflops=100.0,
    bf16_gflops=None,
    int8_gops=None,
    bandwidth_gbs=20.0,
    threads=2,
    measured_at="test",
)
# Conv → Relu twice, named as torch.onnx.export names nodes and tensors; the model's output
# keeps a short name, as exported models' outputs often do
CONV1, RELU1, CONV2, RELU2 = "/conv1/Conv", "/relu1/Relu", "/conv2/Conv", "/relu2/Relu"


def conv_relu_model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
        for name, shape in (("w1", (16, 3, 3, 3)), ("b1", (16,)), ("w2", (16, 16, 3, 3)))
    ]
    pads = [1, 1, 1, 1]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], [f"{CONV1}_output_0"], CONV1, pads=pads),
        helper.make_node("Relu", [f"{CONV1}_output_0"], [f"{RELU1}_output_0"], RELU1),
        helper.make_node(
            "Conv", [f"{RELU1}_output_0", "w2"], [f"{CONV2}_output_0"], CONV2, pads=pads
        ),
        helper.make_node("Relu", [f"{CONV2}_output_0"], ["y"], RELU2),
    ]
    graph = helper.make_graph(
        nodes,
        "conv_relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 32, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 32, 32])],
        weights,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("fused")
    onnx.save(conv_relu_model(), where / "model.onnx")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KILN_HOME", str(where / "home"))
        built = kiln.compile(str(where / "model.onnx"), where / "model.kiln")
    assert "fuse-conv-activation" in [p.name for p in built.manifest.passes if p.rewrites]
    return built.path


@pytest.fixture(scope="module")
def fused(artifact) -> dict:
    return profile_model(str(artifact), runs=4, rounds=2, peaks=PEAKS)


def test_each_fused_kernel_leads_to_the_originals_it_ran(fused):
    convs = [n for n in fused["nodes"] if n["op_type"] == "Conv"]
    assert sorted(sorted(n["original"]) for n in convs) == [
        sorted([CONV1, RELU1]),
        sorted([CONV2, RELU2]),
    ]
    assert all(n["passes"] == ["fuse-conv-activation"] for n in convs)


def test_time_per_original_adds_up_to_the_kernel_time(fused):
    kernels = fused["nodes"]
    per_original: dict[str, float] = defaultdict(float)
    for kernel in kernels:  # as the debugger and the split planner read it
        for name in kernel["original"]:
            per_original[name] += kernel["median_ms"] / len(kernel["original"])
    total = sum(k["median_ms"] for k in kernels)
    assert sum(per_original.values()) == pytest.approx(total)
    # each original is charged by one computing kernel (and the layout changes made for it)
    computing = [k for k in kernels if k["op_type"] not in LAYOUT_OPS]
    for name in (CONV1, RELU1, CONV2, RELU2):
        assert len([k for k in computing if name in k["original"]]) == 1, name


def test_a_kernel_named_after_a_fused_nodes_output_maps_to_that_node():
    # the graph as fuse-conv-activation leaves it: new node names, the tensors' names kept
    fused = [
        helper.make_node("FusedConv", ["x", "w1"], [f"{RELU1}_output_0"], "node_FusedConv_0",
                         domain="com.microsoft", activation="Relu"),
        helper.make_node("FusedConv", [f"{RELU1}_output_0", "w2"], ["y"], "node_FusedConv_1",
                         domain="com.microsoft", activation="Relu"),
    ]  # fmt: skip
    graph = helper.make_graph(fused, "fused", [], [])
    matcher = NodeMatcher(ir.serde.deserialize_model(helper.make_model(graph)))
    # ONNX Runtime names the blocked-layout kernel after the tensor the node computes
    assert matcher.match(f"{RELU1}_output_0_nchwc", "Conv") == ["node_FusedConv_0"]
    # ... a name too short to be searched for inside others too, as it leads the kernel's
    assert matcher.match("y_nchwc", "Conv") == ["node_FusedConv_1"]
    assert matcher.match("ReorderOutput_y", "Conv") == []
    # a layout change named after a tensor runs no node
    assert matcher.match(f"{RELU1}_output_0_reorder", "ReorderOutput") == []


def test_int8_timed_slower_for_the_model_is_not_advised(artifact, tmp_path):
    # peaks that put the Convs at their roof, with int8 kernels four times as fast
    int8_rich = Peaks(1.0, None, 4.0, 1000.0, 2, "test")

    def int8_advice(path: Path) -> list[str]:
        result = profile_model(str(path), runs=2, rounds=1, peaks=int8_rich)
        return [f["action"] for f in result["findings"] if "int8" in f["action"]]

    assert int8_advice(artifact)  # nothing timed: the peaks lead, as something to measure
    timed = shutil.copytree(artifact, tmp_path / "timed.kiln")
    manifest = json.loads((timed / "manifest.json").read_text())
    # as `kiln optimize --precision auto` records int8 verified and slower
    manifest["benchmark"] = {"choice": "ort/fp32", "candidates": {"ort/fp32": 1.0, "ort/int8": 0.9}}
    (timed / "manifest.json").write_text(json.dumps(manifest))
    assert not int8_advice(timed)
