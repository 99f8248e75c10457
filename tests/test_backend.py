"""The ONNX Runtime backend behind the Backend contract."""

from __future__ import annotations

import collections

import numpy as np
import onnx_ir as ir
import pytest

from kiln import zoo
from kiln.backends import get_backend
from kiln.backends.base import KernelRecord, Profile
from kiln.backends.ort import OrtOptions
from kiln.errors import KilnError
from kiln.ir.inputs import synthesize


def test_profile_gives_per_kernel_records_for_each_run():
    model = ir.serde.deserialize_model(zoo.build("resnet-tiny"))
    # No graph optimisation: every kernel is one node of the model, under its own name.
    exe = get_backend("ort").compile(model, OrtOptions(optimization="disable"))
    runs = 3
    profile = exe.profile(synthesize(model), runs=runs)
    assert isinstance(profile, Profile) and profile.engine == "onnxruntime"
    assert len(profile.run_ms) == runs and all(ms > 0 for ms in profile.run_ms)
    records = profile.records
    assert records and all(isinstance(r, KernelRecord) for r in records)
    per_run = collections.Counter(r.run for r in records)
    assert sorted(per_run) == list(range(runs)) and len(set(per_run.values())) == 1
    nodes = {n.name: n.op_type for n in model.graph}
    assert {r.node for r in records} <= set(nodes)
    assert all(r.op_type == nodes[r.node] for r in records)
    assert all(r.dur_us >= 0 and r.ts_us is not None and r.provider for r in records)
    assert exe.providers == ["CPUExecutionProvider"]


def test_session_options_are_applied_and_outputs_do_not_depend_on_them():
    model = ir.serde.deserialize_model(zoo.build("bert-tiny"))
    feeds = synthesize(model)
    ort = get_backend("ort")
    basic = ort.compile(model, OrtOptions(optimization="basic", intra_op_threads=1))
    tuned = ort.compile(
        model,
        OrtOptions(
            optimization="all", spinning=False, memory_arena=False,
            execution_mode="parallel", inter_op_threads=2,
        ),
    )  # fmt: skip
    assert basic.session.get_session_options().intra_op_num_threads == 1
    tuned_options = tuned.session.get_session_options()
    assert tuned_options.execution_mode.name == "ORT_PARALLEL"
    assert tuned_options.inter_op_num_threads == 2
    for a, b in zip(basic.run(feeds), tuned.run(feeds), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_unknown_optimization_level_is_named():
    with pytest.raises(KilnError, match="unknown ORT optimization level 'fast'"):
        OrtOptions(optimization="fast").session_options()


def test_unknown_execution_mode_is_named():
    with pytest.raises(KilnError, match="unknown ORT execution mode 'async'"):
        OrtOptions(execution_mode="async").session_options()


def test_unknown_backend_is_named():
    with pytest.raises(KilnError, match="unknown backend 'tvm'; available: openvino, ort"):
        get_backend("tvm")
