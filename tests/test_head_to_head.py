"""benchmarks/head_to_head.py: Kiln against one hand-run peer across fresh processes."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import kiln

BENCHMARK = Path(__file__).resolve().parent.parent / "benchmarks" / "head_to_head.py"


def test_each_process_compiles_both_in_alternating_order_and_the_ratio_is_pooled(tmp_path):
    artifact = kiln.compile("zoo:resnet-tiny", tmp_path / "r.kiln", verify=False)
    out = tmp_path / "h2h.json"
    done = subprocess.run(
        [sys.executable, str(BENCHMARK), str(artifact.path), "--peer", "ort",
         "--processes", "2", "--rounds", "2", "--runs", "3", "-o", str(out),
         "--results", str(tmp_path / "results")],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert [p["kiln_first"] for p in result["per_process"]] == [True, False]
    ratios = [r for p in result["per_process"] for r in p["round_ratios"]]
    assert len(ratios) == 4 and all(r > 0 for r in ratios)
    assert result["kiln_vs_peer"] == statistics.median(ratios)
    medians = [statistics.median(p["round_ratios"]) for p in result["per_process"]]
    assert result["process_range"] == [min(medians), max(medians)]
    assert result["verdict"] in ("faster", "slower", "no different within noise")
    assert "head-to-head vs ort over 2 processes" in done.stdout
    assert result["machine"]["cores"] >= 1


def test_a_missing_peer_is_refused_with_its_name(tmp_path):
    artifact = kiln.compile("zoo:resnet-tiny", tmp_path / "r.kiln", verify=False)
    done = subprocess.run(
        [sys.executable, str(BENCHMARK), str(artifact.path), "--peer", "onnx-magic",
         "--processes", "1", "--rounds", "1", "--runs", "1", "-o", str(tmp_path / "h.json"),
         "--results", str(tmp_path / "results")],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode != 0 and "onnx-magic" in done.stderr.splitlines()[-1]
    assert not (tmp_path / "h.json").exists()


def test_given_inputs_are_what_both_engines_run(tmp_path):
    import numpy as np
    import onnx_ir as ir

    from kiln.ir.inputs import synthesize

    artifact = kiln.compile("zoo:resnet-tiny", tmp_path / "r.kiln", verify=False)
    feeds = synthesize(ir.load(artifact.path / "model.onnx"), seed=7)
    np.savez(tmp_path / "x.npz", **feeds)
    wrong = {name: value[..., :1] for name, value in feeds.items()}  # the wrong shape
    np.savez(tmp_path / "bad.npz", **wrong)
    args = [sys.executable, str(BENCHMARK), str(artifact.path), "--peer", "ort", "--processes",
            "1", "--rounds", "1", "--runs", "1",
            "--results", str(tmp_path / "results")]  # fmt: skip
    ok = [*args, "--inputs", str(tmp_path / "x.npz"), "-o", str(tmp_path / "ok.json")]
    done = subprocess.run(ok, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    bad = [*args, "--inputs", str(tmp_path / "bad.npz"), "-o", str(tmp_path / "bad.json")]
    refused = subprocess.run(bad, capture_output=True, text=True)
    assert refused.returncode != 0 and not (tmp_path / "bad.json").exists()
    last = refused.stderr.splitlines()[-1]
    assert last.startswith("error: ") and "has shape" in last
