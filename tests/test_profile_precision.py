"""`kiln profile` on quantized and bf16 artifacts: each kernel is placed against the roof of
the precision it ran in, with the bytes it moved, under a roofline with cache ceilings; every
kernel leads to original nodes; advice never proposes a precision the artifact already beats.

The peaks are this machine's, measured once for the module: a kernel above its own roof is
only meaningful against the real limits.
"""

from __future__ import annotations

import re

import pytest

import kiln
from kiln import zoo
from kiln.backends import get_backend
from kiln.cost import NodeCost, node_costs, roofline, total_cost
from kiln.hardware import Peaks
from kiln.hardware import peaks as peaks_module
from kiln.profile import profile_model

# A kernel's time is a median of a few runs on a shared machine, and OpenVINO's counters
# tick in whole microseconds: "above its roof" means beyond that.
NOISE = 0.15
TICK_MS = 0.002


@pytest.fixture(scope="module")
def peaks() -> Peaks:
    return peaks_module.measure()


def compiled(tmp_path_factory, model: str, backend: str, precision: str) -> str:
    where = tmp_path_factory.mktemp(f"{backend}-{precision}")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KILN_HOME", str(where / "home"))
        built = kiln.compile(model, where / "model.kiln", backend=backend, precision=precision)
    return str(built.path)


@pytest.fixture(scope="module")
def openvino_int8(tmp_path_factory, peaks):
    pytest.importorskip("openvino")
    path = compiled(tmp_path_factory, "zoo:resnet-tiny", "openvino", "int8")
    return profile_model(path, runs=6, rounds=2, peaks=peaks)


@pytest.fixture(scope="module")
def ort_int8(tmp_path_factory, peaks):
    path = compiled(tmp_path_factory, "zoo:resnet-tiny", "ort", "int8")
    return profile_model(path, runs=6, rounds=2, peaks=peaks)


@pytest.fixture(scope="module")
def openvino_bf16(tmp_path_factory, peaks):
    pytest.importorskip("openvino")
    from kiln.backends.openvino import cpu_runs_bf16

    if not cpu_runs_bf16():
        pytest.skip("OpenVINO has no bf16 kernels on this CPU")
    path = compiled(tmp_path_factory, "zoo:resnet-tiny", "openvino", "bf16")
    return profile_model(path, runs=6, rounds=2, peaks=peaks)


def over_the_roof(result: dict) -> list[str]:
    """Kernels whose measured time beats the least time their roofs allow, beyond noise."""
    return [
        f"{n['node']}: {n['efficiency']:.0%} of its {n['precision']} roof"
        for n in result["nodes"]
        if "roofline_ms" in n and n["roofline_ms"] > (1 + NOISE) * n["median_ms"] + TICK_MS
    ]


def check_artifact_profile(result: dict, precision: str) -> None:
    nodes = result["nodes"]
    assert not over_the_roof(result)
    assert result["roofline"]["fraction_of_roofline"] < 1 + NOISE
    assert result["roofline"]["fraction_of_peak"] < 1 + NOISE
    # every kernel, the ones the engine inserted included, leads to original nodes
    assert all(n["original"] for n in nodes), [n["node"] for n in nodes if not n["original"]]
    original = {n.name for n in zoo.build("resnet-tiny").graph.node}
    assert all(set(n["original"]) <= original for n in nodes)
    convs = [n for n in nodes if "Conv" in n["op_type"] or "Convolution" in n["op_type"]]
    assert convs and all(n["precision"] == precision for n in convs)
    # never advise a precision the artifact already runs in, or beats (int8 beats bf16;
    # a bf16 artifact may still hear of int8)
    beaten = {"int8", "bf16"} if precision == "int8" else {"bf16"}
    for finding in result["findings"]:
        assert not proposed(finding["action"]) & beaten, finding


def proposed(action: str) -> set[str]:
    """The precisions an action proposes to try ("try int8 or bf16 and measure: ...")."""
    found = re.search(r"try (\w+(?: or \w+)*) and measure", action)
    return set(found.group(1).split(" or ")) if found else set()


def test_openvino_int8_kernels_run_on_the_int8_roof(openvino_int8):
    check_artifact_profile(openvino_int8, "int8")
    convs = [n for n in openvino_int8["nodes"] if n["op_type"] == "Convolution"]
    assert all(n["precision_from"] == "engine" and n["bytes_from"] == "engine" for n in convs)
    # the bytes an int8 kernel moves are int8: a quarter of what the fp32 QDQ graph shows
    # between its Q and DQ nodes (the fp32 bias and scales aside)
    model = zoo.build("resnet-tiny")
    costs = node_costs(model, zoo.entry("resnet-tiny").dims)
    for conv in convs:
        fp32 = total_cost(costs[g] for g in conv["original"] if g in costs)
        assert conv["bytes"] < 0.4 * fp32.bytes, conv["node"]


def test_openvino_int8_fully_connected_maps_to_the_gemm(openvino_int8):
    fc = [n for n in openvino_int8["nodes"] if n["op_type"].startswith("FullyConnected")]
    assert len(fc) == 1 and fc[0]["original"] == ["fc"]
    assert fc[0]["precision"] == "int8"


def test_ort_int8_kernels_run_on_the_int8_roof(ort_int8):
    check_artifact_profile(ort_int8, "int8")
    # ONNX Runtime does not say what it moved: the QDQ graph's boundary tensors at 8 bits
    conv = next(n for n in ort_int8["nodes"] if n["op_type"] == "QLinearConv")
    assert conv["bytes_from"] == "graph"
    model = zoo.build("resnet-tiny")
    costs = node_costs(model, zoo.entry("resnet-tiny").dims)
    assert conv["bytes"] < 0.4 * total_cost(costs[g] for g in conv["original"]).bytes


def test_openvino_bf16_kernels_run_on_the_bf16_roof(openvino_bf16):
    check_artifact_profile(openvino_bf16, "bf16")


def test_a_working_set_that_fits_in_cache_meets_the_cache_roof():
    peaks = Peaks(100.0, None, None, 20.0, 2, "x", None, 1 << 20, 200.0, 8 << 20, 80.0)
    add = NodeCost("Add", flops=1_000, bytes=512 << 10)
    assert roofline(add, 1e-3, peaks)["memory_level"] == "L2"
    assert roofline(add, 1e-3, peaks)["bandwidth_gbs"] == 200.0
    bigger = NodeCost("Add", flops=1_000, bytes=4 << 20)
    assert roofline(bigger, 1e-3, peaks)["memory_level"] == "L3"
    huge = NodeCost("Add", flops=1_000, bytes=64 << 20)
    placed = roofline(huge, 1e-3, peaks)
    assert (placed["memory_level"], placed["bandwidth_gbs"]) == ("DRAM", 20.0)
    # without measured caches (an old cache file, a machine without sysfs) memory's roof
    plain = Peaks(100.0, None, None, 20.0, 2, "x")
    assert roofline(add, 1e-3, plain)["memory_level"] == "DRAM"


@pytest.mark.slow
def test_resnet50_on_openvino_is_convolutions_at_their_roof(peaks):
    pytest.importorskip("openvino")
    assert get_backend("openvino").available()
    result = profile_model("zoo:resnet50", backend="openvino", runs=10, rounds=3, peaks=peaks)
    top = result["op_types"][0]
    assert top["op_type"] == "Convolution" and top["share"] >= 0.7
    costs = node_costs(zoo.build("resnet50"), zoo.entry("resnet50").dims)
    whole = total_cost(costs.values()).flops  # `kiln zoo info resnet50`
    assert result["roofline"]["flops"] == pytest.approx(whole, rel=0.01)
    assert not over_the_roof(result)
    assert all(n["original"] for n in result["nodes"])
    assert "unfused-chains" not in {f["kind"] for f in result["findings"]}


def test_reports_name_openvino_kernels_as_the_table_does(openvino_int8, tmp_path):
    from kiln.report import write_html, write_trace
    from kiln.report.trace import trace_events

    names = {n["node"] for n in openvino_int8["nodes"]}
    events = trace_events(openvino_int8)["traceEvents"]
    kernels = [e for e in events if e["ph"] == "X" and e["cat"] != "run"]
    assert kernels and {e["name"] for e in kernels} <= names
    assert all(e["args"]["original"] and e["args"]["precision"] for e in kernels)
    assert write_html(openvino_int8, tmp_path / "r.html").stat().st_size > 0
    assert write_trace(openvino_int8, tmp_path / "t.json").stat().st_size > 0


def test_advice_proposes_only_narrower_precisions_with_faster_kernels():
    import onnx_ir as ir

    from kiln.profile.diagnose import Context, diagnose

    def kernel(name: str, precision: str, op_type: str = "Conv", **roof) -> dict:
        return {"node": name, "op_type": op_type, "median_ms": 1.0, "precision": precision,
                "graph_nodes": [], "roofline_ms": roof["efficiency"], **roof}  # fmt: skip

    model = ir.serde.deserialize_model(zoo.build("resnet-tiny"))
    rich = Peaks(100.0, 200.0, 400.0, 20.0, 2, "x")  # bf16 and int8 kernels, both faster

    def proposals(kernels: list[dict], peaks: Peaks) -> set[str]:
        found = diagnose(Context(kernels, model, "m.onnx", peaks, None, 2, None))
        return {p for f in found for p in proposed(f.action)}

    memory = {"bound": "memory", "efficiency": 0.5, "flops": 1e6, "bytes": 1e7}
    compute = {"bound": "compute", "efficiency": 0.8, "flops": 1e9, "bytes": 1e6}
    fp32 = [kernel("a", "fp32", **memory), kernel("b", "fp32", **compute)]
    assert proposals(fp32, rich) == {"int8", "bf16"}
    int8 = [kernel("a", "int8", **memory), kernel("b", "int8", **compute)]
    assert not proposals(int8, rich)  # the artifact already beats both
    bf16 = [kernel("a", "bf16", **memory), kernel("b", "bf16", **compute)]
    assert proposals(bf16, rich) == {"int8"}
    # int8 no faster than fp32 here (no int8 dot-product instruction): no int8 advice
    flat = Peaks(100.0, None, 105.0, 20.0, 2, "x")
    assert not proposals([kernel("b", "fp32", **compute), kernel("a", "fp32", **memory)], flat)
    # a narrower build changes MatMul and Conv kernels, not a Softmax at its roof
    assert not proposals([kernel("s", "fp32", "Softmax", **compute)], rich)


def test_a_precision_timed_for_the_model_outranks_the_peaks():
    import onnx_ir as ir

    from kiln.profile.diagnose import Context, diagnose, tried_precisions

    # what `kiln optimize --precision auto` recorded: int8 verified, timed, and slower
    benchmark = {
        "choice": "ort/fp32",
        "candidates": {"ort/fp32": 0.99, "ort/int8": 0.92, "ort/int8 hand:ort-static": 0.93},
    }
    tried = tried_precisions(benchmark)
    assert set(tried) == {"int8"} and "ort/int8 hand:ort-static ran 0.93×" in tried["int8"]
    model = ir.serde.deserialize_model(zoo.build("resnet-tiny"))
    kernels = [
        {"node": "conv", "op_type": "Conv", "median_ms": 1.0, "precision": "fp32",
         "graph_nodes": [], "bound": "compute", "efficiency": 0.8, "roofline_ms": 0.8,
         "flops": 1e9, "bytes": 1e6},
        {"node": "gemm", "op_type": "Gemm", "median_ms": 1.0, "precision": "fp32",
         "graph_nodes": [], "bound": "compute", "efficiency": 0.2, "roofline_ms": 0.2,
         "flops": 1e8, "bytes": 1e6},
    ]  # fmt: skip
    int8_only = Peaks(100.0, None, 400.0, 20.0, 2, "x")  # int8 kernels 4× fp32's peak
    found = {f.kind: f for f in diagnose(Context(kernels, model, "m.onnx", int8_only, None, 2,
                                                 None, tried=tried))}  # fmt: skip
    assert not any(proposed(f.action) for f in found.values())
    assert "int8 not proposed: timed for this model" in found["compute-bound"].evidence
    assert "fp32-compute" not in found  # nothing left to propose for the Gemm
    # where nothing was timed the peaks lead, to a build that is measured before it is kept
    untimed = {f.kind: f for f in diagnose(Context(kernels, model, "m.onnx", int8_only, None,
                                                   2, None))}  # fmt: skip
    assert proposed(untimed["fp32-compute"].action) == {"int8"}
    assert "kiln optimize m.onnx --precision auto" in untimed["fp32-compute"].action
