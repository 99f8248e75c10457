"""A fusion into a contrib op runs only where the fused op is not slower than its parts here
(kiln.passes.fused_op_pays): ORT's SkipLayerNormalization, timed against Add + LayerNorm."""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx_ir as ir
import pytest

import kiln
from kiln.ir.inputs import synthesize
from kiln.ir.load import load_model
from kiln.passes import fused_op_pays


@pytest.mark.parametrize("slower", [True, False])
def test_skip_layernorm_is_fused_only_where_it_is_not_slower(tmp_path, monkeypatch, slower):
    monkeypatch.setenv(fused_op_pays.ENV, "measure")
    planted = {"widths": []}

    def measured(width: int) -> float | None:  # planted: this test is about the decision
        planted["widths"].append(width)
        return 0.3 if slower else None

    monkeypatch.setattr(fused_op_pays, "_fused_over_unfused", measured)
    artifact = kiln.compile("zoo:bert-tiny", tmp_path / "bert.kiln", rounds=0)
    model = ir.load(str(artifact.model_path))
    ops = Counter(node.op_type for node in model.graph)
    assert planted["widths"] and all(w > 0 for w in planted["widths"])
    notes = [p.note for p in artifact.manifest.passes if p.name == "fuse-skip-layernorm"]
    if slower:
        assert "SkipLayerNormalization" not in ops, ops
        assert ops.get("LayerNormalization", 0) >= 2, ops
        assert notes and all("0.30× as fast" in n and "left unfused" in n for n in notes)
    else:
        assert ops.get("SkipLayerNormalization", 0) >= 2, ops
        assert not any(notes)
    assert artifact.manifest.verification.ok  # the same outputs, fused or not
    session = kiln.Session(artifact.path)
    assert all(np.isfinite(o).all() for o in session.run(None, synthesize(model)))
    session.close()


def test_the_measurement_times_both_forms_through_the_engine():
    ratio = fused_op_pays._fused_over_unfused.__wrapped__(64)
    assert ratio is None or 0 < ratio < 1  # a speed ratio, given only when slower


def test_fuse_in_the_environment_skips_the_measurement(monkeypatch):
    monkeypatch.setenv(fused_op_pays.ENV, "fuse")
    monkeypatch.setattr(fused_op_pays, "_fused_over_unfused", lambda w: pytest.fail("timed"))
    assert fused_op_pays.skip_layernorm_slower(load_model("zoo:bert-tiny").model) is None
