"""`kiln bench`'s memory: each engine's peak RSS measured in a process of its own, following
the weights the model holds."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from typer.testing import CliRunner

from kiln.bench.memory import engine_memory
from kiln.cli import app

WIDTH = 1024  # a 1024×1024 fp32 weight: 4 MiB


def _mlp(path: Path, layers: int) -> Path:
    """`layers` MatMuls of WIDTH×WIDTH random weights (random: nothing folds or dedupes)."""
    rng = np.random.default_rng(layers)
    nodes, weights, previous = [], [], "x"
    for i in range(layers):
        weight = rng.standard_normal((WIDTH, WIDTH), dtype=np.float32) / 32
        weights.append(numpy_helper.from_array(weight, f"w{i}"))
        nodes.append(helper.make_node("MatMul", [previous, f"w{i}"], [f"h{i}"]))
        previous = f"h{i}"
    nodes.append(helper.make_node("Identity", [previous], ["y"]))
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WIDTH])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", WIDTH])], weights,
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, path, save_as_external_data=True, location=f"{path.name}.data")
    return path


def test_twice_the_weights_read_twice_the_bytes(tmp_path: Path) -> None:
    feeds = {"x": np.ones((1, WIDTH), np.float32)}
    small = engine_memory(["ort", "openvino"], _mlp(tmp_path / "small.onnx", 8), feeds, runs=3)
    large = engine_memory(["ort", "openvino"], _mlp(tmp_path / "large.onnx", 16), feeds, runs=3)
    for engine in ("ort", "openvino"):
        assert small[engine]["weights_mib"] == pytest.approx(32, rel=0.01)
        assert large[engine]["weights_mib"] == pytest.approx(64, rel=0.01)
        # What the engine holds while serving follows the weights: 32 MiB more per copy it
        # keeps (ONNX Runtime one; OpenVINO reading ONNX, two), plus its own buffers, which
        # do not scale with them.
        grew = large[engine]["peak_rss_mib"]["run"] - small[engine]["peak_rss_mib"]["run"]
        assert 0.75 * 32 < grew < 2.25 * 32, (engine, small[engine], large[engine])
        assert large[engine]["peak_rss_mib"]["run"] > 64
        assert large[engine]["peak_rss_mib"]["load"] >= large[engine]["peak_rss_mib"]["run"] * 0.9


def test_bench_reports_each_engines_memory_and_can_skip_it(tmp_path: Path) -> None:
    model = str(_mlp(tmp_path / "m.onnx", 4))
    runner = CliRunner()
    done = runner.invoke(app, ["bench", model, "--against", "ort", "--rounds", "1", "--runs",
                               "2", "--json"])  # fmt: skip
    assert done.exit_code == 0, done.output
    result = json.loads(done.stdout)
    for name in ("ort", "kiln"):
        engine = result["engines"][name]
        assert set(engine["peak_rss_mib"]) == {"load", "run"}
        assert engine["weights_mib"] == pytest.approx(16, rel=0.05)
        assert engine["peak_rss_mib"]["run"] > 8  # the weights, at least half of them resident
    assert "process of its own" in result["memory"]
    skipped = runner.invoke(app, ["bench", model, "--against", "ort", "--rounds", "1", "--runs",
                                  "2", "--no-memory", "--json"])  # fmt: skip
    assert skipped.exit_code == 0, skipped.output
    assert "peak_rss_mib" not in json.loads(skipped.stdout)["engines"]["ort"]


def test_optimize_reports_the_artifacts_memory_when_asked(tmp_path: Path) -> None:
    """--memory measures the artifact in a process of its own; the figure follows the weights
    (4 × 4 MiB, kept in the artifact's external file, which ONNX Runtime maps: about once).
    Below 64 MiB of weights nothing is measured unless asked."""
    model = _mlp(tmp_path / "mlp.onnx", 4)
    runner = CliRunner()
    args = ["optimize", str(model), "--rounds", "1", "--runs", "1", "--json", "--force"]
    done = runner.invoke(app, [*args, "--memory", "-o", str(tmp_path / "a.kiln")])
    assert done.exit_code == 0, done.output
    memory = json.loads(done.stdout)["benchmark"]["peak_rss_mib"]
    assert 16 * 0.9 < memory["run"] < 16 * 2  # the weights, not nothing and not many copies
    assert memory["load"] <= memory["run"] + 1 and memory["compile"] > memory["run"]
    manifest = json.loads((tmp_path / "a.kiln" / "manifest.json").read_text())
    assert manifest["benchmark"]["peak_rss_mib"] == memory
    unasked = runner.invoke(app, [*args, "-o", str(tmp_path / "b.kiln")])
    assert unasked.exit_code == 0, unasked.output
    assert "peak_rss_mib" not in json.loads(unasked.stdout)["benchmark"]
