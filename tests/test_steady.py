"""Steady by construction: the engines' steadiness options (denormals flushed, threads pinned)
reach the engine, survive the artifact, and a bad value is one line; a session warms at its
largest shape, holds the GC freeze while it is open, and computes the same with every option
on."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import kiln
from kiln.backends import OpenVinoBackend, OpenVinoOptions, OrtBackend, OrtOptions
from kiln.backends.cpus import allowed_cpus, pool_affinities
from kiln.errors import KilnError
from kiln.ir.inputs import synthesize
from kiln.runtime import steady

DENORMAL = np.float32(1e-40)  # below float32's smallest normal (1.2e-38)
WIDTH = 1 << 16  # elements: enough for ONNX Runtime to split the op over its pool
ORT_ALL = {"flush_denormals": True, "pin_threads": True, "intra_op_threads": 2}
OV_ALL = {"flush_denormals": True, "pin_threads": True}


def _identity_mul(path: Path) -> Path:
    """y = x * 1 on a [batch, WIDTH] float input: denormals in, denormals out unless flushed."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", WIDTH])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", WIDTH])
    one = helper.make_tensor("one", TensorProto.FLOAT, [1], [1.0])
    graph = helper.make_graph([helper.make_node("Mul", ["x", "one"], ["y"])], "m", [x], [y], [one])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


@pytest.fixture(scope="module")
def mul(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _identity_mul(tmp_path_factory.mktemp("steady") / "mul.onnx")


def _denormals() -> dict[str, np.ndarray]:
    return {"x": np.full((4, WIDTH), DENORMAL, np.float32)}


def _entry(so, key: str) -> str | None:
    """A session config entry of ONNX Runtime SessionOptions; None where it was never set."""
    try:
        return so.get_session_config_entry(key)
    except RuntimeError:
        return None


def _ieee_here() -> bool:
    """Whether this thread keeps denormals (numpy computes on it)."""
    return bool(np.float32(DENORMAL) * np.float32(1) != 0)


@pytest.fixture(autouse=True)
def _this_thread_stays_ieee(mul: Path):
    """Both engines flush denormals on the thread that runs them too, for good (ONNX Runtime:
    the thread that opens the process's first session follows that session's option;
    OpenVINO: the thread an inference ran on). The tests here must not leave pytest's thread
    so: ONNX Runtime's first session is opened without it, and OpenVINO is told NO after."""
    OrtBackend().compile(str(mul), OrtOptions())
    yield
    if not _ieee_here():
        OpenVinoBackend().compile(str(mul), OpenVinoOptions(flush_denormals=False)).run(
            _denormals()
        )
    assert _ieee_here()


def _zeros_in_a_process_of_its_own(mul: Path, options: str) -> tuple[int, bool]:
    """Zeros of y = x * 1 on denormals, and whether numpy keeps denormals after, with the
    process's first ONNX Runtime session opened with `options`."""
    code = (
        "import numpy as np\n"
        "from kiln.backends import OrtBackend, OrtOptions\n"
        f"exe = OrtBackend().compile({str(mul)!r}, OrtOptions({options}))\n"
        f"y = exe.run({{'x': np.full((4, {WIDTH}), np.float32(1e-40))}})[0]\n"
        "print(int((y == 0).sum()), bool(np.float32(1e-40) * np.float32(1) != 0))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    zeros, ieee = done.stdout.split()
    return int(zeros), ieee == "True"


def test_ort_flush_denormals_reaches_the_engine(mul: Path) -> None:
    flushed = OrtBackend().compile(str(mul), OrtOptions(flush_denormals=True))
    entries = flushed.session.get_session_options()
    assert entries.get_session_config_entry("session.set_denormal_as_zero") == "1"
    # The key is one ONNX Runtime acts on, not one it ignores: every element flushed. As its
    # first session, it flushes the opening thread's arithmetic too (numpy's there).
    assert _zeros_in_a_process_of_its_own(mul, "flush_denormals=True") == (4 * WIDTH, False)
    assert _zeros_in_a_process_of_its_own(mul, "") == (0, True)


@pytest.mark.skipif(len(allowed_cpus()) < 2, reason="pinning a pool needs 2 CPUs")
def test_ort_pin_threads_pins_each_pool_thread(mul: Path) -> None:
    before = set(os.listdir("/proc/self/task"))
    options = OrtOptions(intra_op_threads=2, pin_threads=True)
    exe = OrtBackend().compile(str(mul), options)
    exe.run(_denormals())
    affinities = pool_affinities(2)
    entries = exe.session.get_session_options()
    assert entries.get_session_config_entry("session.intra_op_thread_affinities") == affinities
    pinned = {int(c) - 1 for c in affinities.split(",")}
    deadline = time.monotonic() + 5  # a new thread pins itself as it starts
    while time.monotonic() < deadline:
        new = [int(t) for t in set(os.listdir("/proc/self/task")) - before]
        if new and all(os.sched_getaffinity(t) == pinned for t in new):
            break
        time.sleep(0.01)
    assert new and all(os.sched_getaffinity(t) == pinned for t in new)


def test_ort_pins_nothing_it_pins_itself_or_cannot(mul: Path) -> None:
    # 0 threads: ONNX Runtime's own pool, pinned by ONNX Runtime; 1: no pool at all.
    for threads in (0, 1):
        so = OrtOptions(intra_op_threads=threads, pin_threads=True).session_options()
        assert _entry(so, "session.intra_op_thread_affinities") is None
    too_many = len(allowed_cpus()) + 1  # more threads than CPUs: left unpinned, not refused
    so = OrtOptions(intra_op_threads=too_many, pin_threads=True).session_options()
    assert _entry(so, "session.intra_op_thread_affinities") is None


def test_pool_affinities_physical_cores_first() -> None:
    two_cores = {0: ("0", "0"), 1: ("0", "1")}
    assert pool_affinities(2, [0, 1], two_cores.__getitem__) == "2"  # one group: one pool thread
    assert pool_affinities(3, [0, 1], two_cores.__getitem__) is None
    # 2 cores × 2 hyper-threads, siblings 0/2 and 1/3 (Linux numbering)
    smt = {0: ("0", "0"), 1: ("0", "1"), 2: ("0", "0"), 3: ("0", "1")}
    assert pool_affinities(2, [0, 1, 2, 3], smt.__getitem__) == "2,4"  # a whole core
    assert pool_affinities(4, [0, 1, 2, 3], smt.__getitem__) == "2;3;4"  # cores, then siblings
    # a container allowed CPUs 4 and 5 only: ids are those, 1-based
    assert pool_affinities(2, [4, 5], lambda c: ("0", str(c))) == "6"


@pytest.mark.parametrize(
    ("engine", "options", "name"),
    [
        ("ort", OrtOptions(flush_denormals="yes"), "flush_denormals"),
        ("ort", OrtOptions(pin_threads=1), "pin_threads"),
        ("ort", OrtOptions(stop_spinning="no"), "stop_spinning"),
        ("openvino", OpenVinoOptions(flush_denormals="YES"), "flush_denormals"),
        ("openvino", OpenVinoOptions(pin_threads=0), "pin_threads"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_option(engine, options, name) -> None:
    with pytest.raises(KilnError, match=f"option '{name}' must be true") as caught:
        options.session_options() if engine == "ort" else options.properties()
    assert "\n" not in str(caught.value)


def test_a_bad_value_through_a_session_is_refused(mul: Path) -> None:
    with pytest.raises(KilnError, match="'pin_threads' must be true or false"):
        kiln.Session(str(mul), options={"pin_threads": "on"})


# ------------------------------------------------------------------ OpenVINO


def test_openvino_options_reach_the_compiled_model(mul: Path) -> None:
    exe = OpenVinoBackend().compile(
        str(mul), OpenVinoOptions(flush_denormals=True, pin_threads=False)
    )
    settings = exe.settings()  # read back from the compiled model
    assert (settings["flush_denormals"], settings["pin_threads"]) == ("True", "False")
    assert (exe.run(_denormals())[0] == 0).all()
    props = OpenVinoOptions().properties()  # None: OpenVINO's own defaults, nothing said
    assert "CPU_DENORMALS_OPTIMIZATION" not in props and "ENABLE_CPU_PINNING" not in props


def test_openvino_refuses_a_key_it_does_not_know(mul: Path) -> None:
    # What Kiln relies on: OpenVINO names an unknown key; ONNX Runtime would ignore it, so
    # its keys are checked by their effect above.
    options = OpenVinoOptions(extra={"CPU_DENORMALS_OPTIMISATION": "YES"})
    with pytest.raises(KilnError, match="CPU_DENORMALS_OPTIMISATION"):
        OpenVinoBackend().compile(str(mul), options)


# ------------------------------------------------------------------ artifacts


@pytest.mark.parametrize(("backend", "options"), [("ort", ORT_ALL), ("openvino", OV_ALL)])
def test_options_survive_the_artifact(tmp_path: Path, mul: Path, backend, options) -> None:
    artifact = kiln.compile(
        mul, tmp_path / "a.kiln", backend=backend, engine_options=options, verify=False, rounds=0
    )
    recorded = json.loads((artifact.path / "manifest.json").read_text())["backend"]["options"]
    assert {k: recorded[k] for k in options} == options
    with kiln.Session(artifact.path) as session:
        assert {k: session.options[k] for k in options} == options
        if backend == "ort":
            entries = session.executable.session.get_session_options()
            assert entries.get_session_config_entry("session.set_denormal_as_zero") == "1"
        else:
            assert session.executable.settings()["flush_denormals"] == "True"


# ------------------------------------------------------------------ the session


def test_a_session_warms_at_its_largest_bucket_and_freezes_the_gc(monkeypatch, mul) -> None:
    warmed: list[tuple[int, ...]] = []
    synthesize_ = steady.synthesize
    monkeypatch.setattr(
        steady, "synthesize", lambda m, dims: warmed.append(dims) or synthesize_(m, dims)
    )
    holders = steady._holders
    with kiln.Session(str(mul), buckets={"batch": [1, 4]}) as session:
        assert warmed == [{"batch": 4}]
        assert gc.get_freeze_count() > 0
        assert session.stats()["requests"] == 0  # the warm-up is no request
    assert steady._holders == holders  # given back on close
    if holders == 0:
        assert gc.get_freeze_count() == 0
    with kiln.Session(str(mul), steady=False):
        assert steady._holders == holders


def test_a_model_the_warm_up_cannot_run_still_opens(monkeypatch, mul) -> None:
    def fail(*_args: object) -> None:
        raise KilnError("no inputs for you")

    monkeypatch.setattr("kiln.runtime.session.warm_up", fail)
    with kiln.Session(str(mul)) as session:
        assert "no inputs for you" in session.stats()["decisions"][-1]["action"]
        assert session.run(None, _denormals())[0].shape == (4, WIDTH)


@pytest.mark.parametrize(
    ("model", "backend", "options"),
    [("zoo:bert-tiny", "ort", ORT_ALL), ("zoo:resnet-tiny", "openvino", OV_ALL)],
)
def test_every_option_on_computes_the_same(model, backend, options) -> None:
    extra = {"inference_precision": "f32"} if backend == "openvino" else {}
    with kiln.Session(model, backend=backend, steady=False, options=extra or None) as plain:
        feeds = synthesize(plain.interface)
        want = plain.run(None, feeds)
    with kiln.Session(model, backend=backend, options={**options, **extra}) as steadied:
        got = steadied.run(None, feeds)
    for w, g in zip(want, got, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


_CROWD_SCRIPT = """
import gc, json, sys
import numpy as np
import onnx_ir as ir
from kiln import zoo
import kiln.backends.ort
from kiln.backends import get_backend
from kiln.ir.inputs import synthesize
kiln.backends.ort.STOP_SPINNING_BYTES = 0  # bert-tiny counts as a model with weights to share
path = sys.argv[1]
ir.save(ir.serde.deserialize_model(zoo.build("bert-tiny")), path)
feeds = synthesize(ir.load(path), {"batch": 1, "seq": 16})
ort = get_backend("ort")
first = ort.compile(path)
alone = first.stopped
want = first.run(feeds)
spinning = first.session
second = ort.compile(path)
after = [first.stopped, second.stopped]
reopened = first.session is not spinning  # a new ORT session, with force_spinning_stop
del spinning
same = all(np.array_equal(a, b) for a, b in zip(first.run(feeds), want, strict=True))
kept = first.stopped
del first, second
gc.collect()
lone = ort.compile(path)  # alone again: it spins
again = lone.stopped
from kiln.backends import share_process
share_process()  # a server: its event loop shares the cores
served = ort.compile(path)
print(json.dumps({"alone": alone, "after": after, "reopened": reopened, "same": same,
                  "kept": kept, "again": again, "server": [lone.stopped, served.stopped]}))
"""


def test_an_ort_pool_spins_alone_and_stops_after_each_run_once_another_opens_or_it_serves(
    tmp_path,
) -> None:
    # A fresh process: executables other tests hold would count as company.
    done = subprocess.run([sys.executable, "-c", _CROWD_SCRIPT, str(tmp_path / "m.onnx")],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    state = json.loads(done.stdout.strip().splitlines()[-1])
    assert state == {"alone": False, "after": [True, True], "reopened": True, "same": True,
                     "kept": True, "again": False, "server": [True, True]}  # fmt: skip


_OTHER_ENGINE_SCRIPT = """
import gc, json, os, shutil, sys
import numpy as np
import onnx_ir as ir
import kiln
from kiln import zoo
import kiln.backends.ort
from kiln.backends import get_backend
from kiln.ir.inputs import synthesize
path = sys.argv[1]
ir.save(ir.serde.deserialize_model(zoo.build("bert-tiny")), path)
feeds = synthesize(ir.load(path), {"batch": 1, "seq": 16})
ort = get_backend("ort")
small = [ort.compile(path), ort.compile(path)]  # bert-tiny: a small model's pool
want = small[0].run(feeds)
state = {"small": [s.stopped for s in small]}
peer = get_backend("openvino").compile(path)  # an instrument, as kiln bench's peers
state["beside_peer"] = [s.stopped for s in small]
session = kiln.Session("zoo:resnet-tiny", backend="openvino")
session.run(None, synthesize(session.interface))
state["beside_session"] = [s.stopped for s in small]
state["opened_beside_session"] = ort.compile(path).stopped
state["same"] = all(np.array_equal(a, b) for a, b in zip(small[0].run(feeds), want, strict=True))
session.close()
del small, session
gc.collect()
small = [ort.compile(path), ort.compile(path)]  # alone again: they spin
state["again"] = [s.stopped for s in small]
kiln.backends.ort.STOP_SPINNING_BYTES = 0  # bert-tiny now counts as a large model
large = ort.compile(path)
state["beside_large"] = [small[0].stopped, small[1].stopped, large.stopped]
kiln.backends.ort.STOP_SPINNING_BYTES = 4 * 2**20
del small, large
gc.collect()
shutil.copy(path, path + ".lost")
lost = ort.compile(path + ".lost")  # its file deleted under it: it can never be reopened
os.remove(path + ".lost")
with kiln.Session("zoo:resnet-tiny", backend="openvino") as other:  # opens all the same
    other.run(None, synthesize(other.interface))
    state["beside_a_lost_file"] = lost.stopped
state["after_close"] = ort.compile(path).stopped  # closed, not yet collected: no company
print(json.dumps(state))
"""


def test_an_ort_pool_stops_once_a_session_on_another_engine_shares_the_process(tmp_path) -> None:
    # OpenVINO int8 bert-base beside a spinning ORT fp32 artifact, run by run, kept 0.62x of
    # its speed alone (beside a spinning bert-tiny 0.58x): a kiln.Session on another engine is
    # company, and a small pool stops beside it or a large one, not beside another small one.
    # A fresh process, as above; the peers kiln bench opens only to time them are not company.
    done = subprocess.run([sys.executable, "-c", _OTHER_ENGINE_SCRIPT, str(tmp_path / "m.onnx")],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    state = json.loads(done.stdout.strip().splitlines()[-1])
    assert state == {
        "small": [False, False],  # two small pools spin beside each other
        "beside_peer": [False, False],
        "beside_session": [True, True],
        "opened_beside_session": True,
        "same": True,
        "again": [False, False],
        "beside_large": [True, True, True],
        "beside_a_lost_file": False,  # could not be reopened: it spins on, and nothing failed
        "after_close": False,
    }
