"""Bad input: one clear line naming the problem and what to do, exit code 2, no traceback,
and nothing left behind. The messages are part of the user contract, so each is asserted whole.

The CLI runs as a real subprocess (`python -m kiln`). Starting one costs a few seconds of
imports, so every case is prepared in its own directory and all of them run concurrently once
per module; each test then checks its own case.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import kiln
from kiln.artifact import BackendInfo, Manifest, SourceInfo, new_manifest, write_artifact
from kiln.config import CompileConfig
from kiln.errors import KilnError
from kiln.ir.load import MAX_OPSET, load_model

# ---------------------------------------------------------------- tiny models


def model_proto(
    op: str = "Relu", domain: str = "", opset: int = 17, weight: onnx.TensorProto | None = None
) -> onnx.ModelProto:
    """y = op(x), or y = x + w when a weight is given; x and y are float32[1, 4]."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    if weight is None:
        node = helper.make_node(op, ["x"], ["y"], name="n0", domain=domain)
    else:
        node = helper.make_node("Add", ["x", weight.name], ["y"], name="n0")
    graph = helper.make_graph([node], "g", [x], [y], [weight] if weight is not None else [])
    opsets = [helper.make_opsetid("", opset)]
    if domain:
        opsets.append(helper.make_opsetid(domain, 1))
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def two_input_model() -> onnx.ModelProto:
    """y = x + b, both float32[1, 4]: the model `kiln run` is given inputs for."""
    spec = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 4]) for n in "xby"]
    node = helper.make_node("Add", ["x", "b"], ["y"], name="add")
    graph = helper.make_graph([node], "g", spec[:2], spec[2:])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def external_weight(location: str, offset: int = 0, length: int = 16) -> onnx.TensorProto:
    """A float32[1, 4] weight 'w' whose bytes live in an external file at `location`."""
    tensor = numpy_helper.from_array(np.ones((1, 4), np.float32), "w")
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    return tensor


def save(proto: onnx.ModelProto, path: Path) -> None:
    path.write_bytes(proto.SerializeToString())


# ---------------------------------------------------------------- the cases

OPTIMIZE = ["optimize", "model.onnx", "-o", "model.kiln", "--rounds", "0"]
RUN = ["run", "{artifact}", "--inputs", "inputs.npz", "-o", "out.npz"]


@dataclass
class Case:
    setup: Callable[[Path], None]  # writes the bad input into the case's directory
    args: list[str]
    message: str  # the whole message after "error: "
    api: bool = False  # kiln.compile("model.onnx") must raise the same message
    cli: bool = True  # False: checked through the API only (each CLI run costs seconds)


def _text(d: Path) -> None:
    (d / "model.onnx").write_text("This is a README, renamed.\nIt is not a model.\n")


def _truncated(d: Path) -> None:
    data = model_proto().SerializeToString()
    (d / "model.onnx").write_bytes(data[: len(data) // 2])


def _non_artifact_dir(d: Path) -> None:
    save(model_proto(), d / "model.onnx")
    (d / "model.kiln").mkdir()
    (d / "model.kiln" / "notes.txt").write_text("precious\n")


def _short_external_data(d: Path) -> None:
    save(model_proto(weight=external_weight("model.data", length=16)), d / "model.onnx")
    (d / "model.data").write_bytes(bytes(10))


def _changed(change: Callable[[onnx.ModelProto], None]) -> Callable[[Path], None]:
    """Writes model.onnx: the Relu model of `model_proto`, changed."""

    def setup(d: Path) -> None:
        proto = model_proto()
        change(proto)
        save(proto, d / "model.onnx")

    return setup


def _external_through_a_link(d: Path) -> None:
    """The weight's file is a link inside the model's directory to a file outside it."""
    (d / "outside.bin").write_bytes(bytes(16))
    (d / "m").mkdir()
    (d / "m" / "link.bin").symlink_to("../outside.bin")
    save(model_proto(weight=external_weight("link.bin")), d / "m" / "model.onnx")


def _external_key(d: Path) -> None:
    weight = external_weight("model.data")
    entry = weight.external_data.add()
    entry.key, entry.value = "lenght", "16"
    save(model_proto(weight=weight), d / "model.onnx")
    (d / "model.data").write_bytes(bytes(16))


def _external_short_for_its_shape(d: Path) -> None:
    save(model_proto(weight=external_weight("model.data", length=8)), d / "model.onnx")
    (d / "model.data").write_bytes(bytes(16))


def _one_value_too_many(d: Path) -> None:
    """Valid for the ONNX checker, refused by ONNX Runtime (which also logs it on its own)."""
    weight = numpy_helper.from_array(ONES, "w")
    weight.ClearField("raw_data")
    weight.float_data.extend([1.0] * 5)  # the shape [1, 4] holds 4
    save(model_proto(weight=weight), d / "model.onnx")


def _self_loop(proto: onnx.ModelProto) -> None:
    proto.graph.node[0].input[0] = "y"


def _no_outputs(proto: onnx.ModelProto) -> None:
    proto.graph.ClearField("output")


def _untyped_input(proto: onnx.ModelProto) -> None:
    proto.graph.input[0].type.tensor_type.elem_type = TensorProto.UNDEFINED


def _npz(**arrays: np.ndarray) -> Callable[[Path], None]:
    return lambda d: np.savez(d / "inputs.npz", **arrays)


ONES = np.ones((1, 4), np.float32)
NOT_IN_ONNX = "Re-export the model with standard ONNX operators."
OUTSIDE = (
    "outside the model's directory; refusing to read it. Keep external data files next to "
    "the model."
)

CASES: dict[str, Case] = {
    "missing-file": Case(
        lambda d: None,
        ["optimize", "missing.onnx", "-o", "model.kiln", "--rounds", "0"],
        "missing.onnx: no such file. Give a path to an .onnx file or zoo:NAME.",
    ),
    "directory": Case(
        lambda d: (d / "model.onnx").mkdir(),
        OPTIMIZE,
        "model.onnx: is a directory, not an ONNX model file. Give the .onnx file.",
        api=True,
        cli=False,
    ),
    "empty-file": Case(
        lambda d: (d / "model.onnx").write_bytes(b""),
        OPTIMIZE,
        "model.onnx: is empty, not an ONNX model. Re-export or re-download it.",
        api=True,
        cli=False,
    ),
    "text-file": Case(
        _text,
        OPTIMIZE,
        "model.onnx: is a text file, not an ONNX model. Give the binary .onnx file your "
        "exporter wrote.",
        api=True,
    ),
    "truncated-protobuf": Case(
        _truncated,
        OPTIMIZE,
        "model.onnx: is not a valid ONNX model (the protobuf is truncated, corrupted or of "
        "another format). Re-export or re-download it.",
        api=True,
    ),
    "opset-99": Case(
        lambda d: save(model_proto(opset=99), d / "model.onnx"),
        OPTIMIZE,
        f"model.onnx: uses ONNX opset 99, newer than the {MAX_OPSET} this Kiln supports. "
        f"Re-export with opset <= {MAX_OPSET} or upgrade onnx.",
        api=True,
    ),
    "unknown-op": Case(
        lambda d: save(model_proto(op="FooBar"), d / "model.onnx"),
        OPTIMIZE,
        "model.onnx: node 'n0' uses operator 'FooBar', which is not in ONNX opset 17. "
        f"{NOT_IN_ONNX}",
        api=True,
    ),
    "unknown-domain": Case(
        lambda d: save(model_proto(op="FooBar", domain="com.example"), d / "model.onnx"),
        OPTIMIZE,
        "model.onnx: node 'n0' uses operator 'FooBar' from domain 'com.example', which no "
        f"engine Kiln drives knows. {NOT_IN_ONNX}",
        api=True,
    ),
    "external-data-traversal": Case(
        lambda d: save(model_proto(weight=external_weight("../../etc/passwd")), d / "model.onnx"),
        OPTIMIZE,
        f"model.onnx: weight 'w' points to external data '../../etc/passwd' {OUTSIDE}",
        api=True,
    ),
    "external-data-absolute": Case(
        lambda d: save(model_proto(weight=external_weight("/etc/passwd")), d / "model.onnx"),
        OPTIMIZE,
        f"model.onnx: weight 'w' points to external data '/etc/passwd' {OUTSIDE}",
        api=True,
    ),
    "external-data-missing": Case(
        lambda d: save(model_proto(weight=external_weight("model.data")), d / "model.onnx"),
        OPTIMIZE,
        "model.onnx: weight 'w' needs external data file 'model.data', which does not exist "
        "(looked for model.data). Put it next to the model.",
        api=True,
    ),
    "external-data-truncated": Case(
        _short_external_data,
        OPTIMIZE,
        "model.onnx: weight 'w' needs bytes 0..16 of external data file 'model.data', which "
        "has only 10; the file is truncated. Re-export or re-download it.",
        api=True,
        cli=False,
    ),
    "external-data-through-a-link": Case(
        _external_through_a_link,
        ["optimize", "m/model.onnx", "-o", "model.kiln", "--rounds", "0"],
        f"m/model.onnx: weight 'w' points to external data 'link.bin' {OUTSIDE}",
    ),
    "external-data-unknown-key": Case(
        _external_key,
        OPTIMIZE,
        "model.onnx: weight 'w' has unknown external data key 'lenght' (ONNX knows basepath, "
        "checksum, length, location, offset); the file is corrupted. Re-export the model.",
        api=True,
        cli=False,
    ),
    "external-data-short-for-its-shape": Case(
        _external_short_for_its_shape,
        OPTIMIZE,
        "model.onnx: weight 'w' has shape [1, 4], 16 bytes, but its external data in "
        "'model.data' holds 8; the model is corrupted. Re-export the model.",
        api=True,
        cli=False,
    ),
    "cycle": Case(
        _changed(_self_loop),
        OPTIMIZE,
        "model.onnx: is not a valid ONNX model: Nodes in a graph must be topologically sorted, "
        "however input 'y' of node: name: n0 OpType: Relu is not output of any previous nodes. "
        "Re-export it (onnx.checker shows the same).",
        api=True,
    ),
    "no-outputs": Case(
        _changed(_no_outputs),
        OPTIMIZE,
        "model.onnx: the graph has no outputs; there is nothing to run. Re-export the model.",
        api=True,
        cli=False,
    ),
    "input-of-no-type": Case(
        _changed(_untyped_input),
        OPTIMIZE,
        "model.onnx: input 'x' has no valid element type (elem_type 0). Re-export the model.",
        api=True,
        cli=False,
    ),
    # ONNX Runtime's own log line ("[E:onnxruntime:...]") stays off the terminal; its message
    # is said once, without its C++ source locations and signatures.
    "engine-refuses-the-model": Case(
        _one_value_too_many,
        OPTIMIZE,
        "ONNX Runtime cannot load the model: Initializer 'w': data field count (5) does not "
        "match expected count from shape (4)",
    ),
    "output-is-not-an-artifact": Case(
        _non_artifact_dir,
        OPTIMIZE,
        "model.kiln: exists and is not a Kiln artifact; refusing to replace it. Choose "
        "another -o path, remove it first, or pass --force.",
    ),
    "inputs-missing-file": Case(
        lambda d: None,
        RUN,
        "inputs.npz: no such inputs file. Give an .npz with one array per input.",
    ),
    "inputs-not-npz": Case(
        lambda d: (d / "inputs.npz").write_text("x,b\n1,2\n"),
        RUN,
        "inputs.npz: not an .npz file. Save the inputs with numpy.savez(path, NAME=array, ...), "
        "one array per model input.",
    ),
    "inputs-missing-input": Case(
        _npz(x=ONES),
        RUN,
        "inputs.npz: missing input 'b' (expected float32[1, 4]). Give one array per model input.",
    ),
    "inputs-wrong-dtype": Case(
        _npz(x=ONES.astype(np.float64), b=ONES),
        RUN,
        "inputs.npz: input 'x' has dtype float64, expected float32[1, 4]. Convert it with "
        ".astype('float32').",
    ),
    "inputs-text-for-a-float": Case(
        _npz(x=np.array([["1", "2", "3", "4"]]), b=ONES),
        RUN,
        "inputs.npz: input 'x' has dtype <U1, expected float32[1, 4]. Convert it with "
        ".astype('float32').",
    ),
    "inputs-pickled-object-array": Case(
        _npz(x=np.array([["a", "b", "c", "d"]], dtype=object), b=ONES),
        RUN,
        "inputs.npz: array 'x' is a pickled object array, which Kiln does not load. Save "
        "strings as a numpy text array, e.g. np.array(texts, dtype=str), and other inputs with "
        "their numeric dtype.",
    ),
    "inputs-wrong-rank": Case(
        _npz(x=ONES[0], b=ONES),
        RUN,
        "inputs.npz: input 'x' has shape [4], expected float32[1, 4]. Give an array of that shape.",
    ),
    "inputs-unknown-name": Case(
        _npz(x=ONES, b=ONES, z=ONES),
        RUN,
        "inputs.npz: unknown input 'z'; the model's inputs are ['b', 'x']. Name each array "
        "after a model input.",
    ),
}


# ---------------------------------------------------------------- running the CLI


@dataclass
class Outcome:
    directory: Path
    before: dict[str, bytes | None]  # every path under the directory → its bytes (None: dir)
    proc: subprocess.CompletedProcess


def snapshot(directory: Path) -> dict[str, bytes | None]:
    return {
        str(p.relative_to(directory)): None if p.is_dir() else p.read_bytes()
        for p in sorted(directory.rglob("*"))
    }


def kiln_cli(args: list[str], cwd: Path, home: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
    env.update(KILN_HOME=str(home), COLUMNS="30")  # a narrow terminal must not wrap the line
    return subprocess.run(
        [sys.executable, "-m", "kiln", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, Outcome]:
    home = tmp_path_factory.mktemp("kiln-home")
    built = tmp_path_factory.mktemp("artifact")
    save(two_input_model(), built / "add.onnx")
    artifact = str(built / "add.kiln")
    prepared = {}
    for name, case in CASES.items():
        if case.cli:
            directory = tmp_path_factory.mktemp(name)
            case.setup(directory)
            args = [a.format(artifact=artifact) for a in case.args]
            prepared[name] = (directory, snapshot(directory), args)
    with ThreadPoolExecutor(max_workers=4) as pool:
        build = pool.submit(
            kiln_cli, ["optimize", "add.onnx", "-o", "add.kiln", "--rounds", "0"], built, home
        )
        # Cases that need no artifact start at once; `kiln run` cases once it is built.
        procs = {
            name: pool.submit(kiln_cli, args, directory, home)
            for name, (directory, _, args) in prepared.items()
            if args[0] != "run"
        }
        assert build.result().returncode == 0, build.result().stderr
        for name, (directory, _, args) in prepared.items():
            if args[0] == "run":
                procs[name] = pool.submit(kiln_cli, args, directory, home)
        return {
            name: Outcome(directory, before, procs[name].result())
            for name, (directory, before, _) in prepared.items()
        }


def assert_one_line_error(proc: subprocess.CompletedProcess, message: str) -> None:
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [f"error: {message}"]


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.cli])
def test_cli_refuses_bad_input_with_one_clear_line(name, outcomes):
    outcome, case = outcomes[name], CASES[name]
    assert_one_line_error(outcome.proc, case.message)
    # Nothing written, nothing changed, no hidden temporary directory left behind.
    assert snapshot(outcome.directory) == outcome.before
    assert not [p for p in os.listdir(outcome.directory) if p.startswith(".")]


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.api])
def test_api_raises_the_same_message(name, tmp_path, monkeypatch):
    CASES[name].setup(tmp_path)
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    with pytest.raises(KilnError) as info:
        kiln.compile("model.onnx", rounds=0)
    assert str(info.value) == CASES[name].message
    assert snapshot(tmp_path) == before


def test_api_missing_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(KilnError) as info:
        kiln.compile("missing.onnx", rounds=0)
    assert str(info.value) == CASES["missing-file"].message
    assert not list(tmp_path.iterdir())


def test_session_on_a_directory_that_is_not_an_artifact(tmp_path, monkeypatch):
    (tmp_path / "model.kiln").mkdir()
    monkeypatch.chdir(tmp_path)
    with pytest.raises(KilnError) as info:
        kiln.Session("model.kiln")
    assert str(info.value) == (
        "model.kiln: not a Kiln artifact (no manifest.json). Build one with kiln optimize."
    )


def test_an_input_no_machine_holds_is_refused(tmp_path, monkeypatch):
    """A corrupted dim (2^40) is refused before Kiln tries to make such an input."""
    proto = model_proto()
    proto.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 1 << 40
    save(proto, tmp_path / "model.onnx")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(KilnError, match=r"input 'x' has shape 1x1099511627776, larger than"):
        kiln.compile("model.onnx", rounds=0)


def test_a_shapeless_input_is_not_refused(tmp_path):
    """The ONNX checker wants a shape on every graph input; ONNX Runtime does not, and nor
    does Kiln, with weights beside the model too."""
    proto = model_proto(weight=external_weight("model.data"))
    proto.graph.input[0].type.tensor_type.ClearField("shape")
    save(proto, tmp_path / "model.onnx")
    (tmp_path / "model.data").write_bytes(ONES.tobytes())
    loaded = load_model(str(tmp_path / "model.onnx"))
    assert loaded.model.graph.inputs[0].shape is None
    np.testing.assert_array_equal(loaded.model.graph.initializers["w"].const_value.numpy(), ONES)


@pytest.fixture
def artifact(tmp_path) -> Path:
    save(model_proto(), tmp_path / "relu.onnx")
    return kiln.compile(str(tmp_path / "relu.onnx"), tmp_path / "relu.kiln", rounds=0).path


def test_a_damaged_artifact_model_is_rebuilt_not_re_exported(artifact):
    proto = model_proto()
    _self_loop(proto)
    save(proto, artifact / "model.onnx")
    with pytest.raises(KilnError) as info:
        kiln.Session(artifact)
    assert str(info.value) == (
        f"{artifact}/model.onnx: is not a valid ONNX model: Nodes in a graph must be "
        "topologically sorted, however input 'y' of node: name: n0 OpType: Relu is not output "
        f"of any previous nodes. The artifact {artifact} is damaged; rebuild it with kiln "
        "optimize."
    )


@pytest.mark.parametrize("damage", [b"\xff\xfe", b"[1, 2]", b'{"n0": {"origin": 3}}', None])
def test_a_damaged_provenance_is_one_line(artifact, damage):
    where = artifact / "provenance.json"
    if damage is None:
        where.unlink()
    else:
        where.write_bytes(damage)
    with pytest.raises(KilnError) as info:
        kiln.artifact.read_artifact(artifact).provenance()
    message = str(info.value)
    assert len(message.splitlines()) == 1 and message.endswith("Rebuild it with kiln optimize.")


# ---------------------------------------------------------------- writing the artifact


def _manifest(model: ir.Model, note: str = "") -> Manifest:
    return new_manifest(
        source=SourceInfo("model", note, "0"), model=model, config=CompileConfig(),
        backend=BackendInfo("ort"), passes=[], dropped_passes=[], nodes={},
        precision={"default": "fp32", "nodes": {}}, dims={}, verification=None,
    )  # fmt: skip


def _no_space(*args, **kwargs):
    raise OSError(28, "No space left on device")


def test_full_disk_leaves_no_partial_artifact(tmp_path, monkeypatch):
    model = ir.serde.deserialize_model(model_proto())
    monkeypatch.setattr(ir, "save", _no_space)
    destination = tmp_path / "model.kiln"
    with pytest.raises(KilnError) as info:
        write_artifact(destination, model, _manifest(model))
    assert str(info.value) == (
        f"{destination}: could not write the artifact (No space left on device). Nothing was "
        "written; fix that or choose another -o path."
    )
    assert list(tmp_path.iterdir()) == []


def test_full_disk_keeps_the_previous_artifact(tmp_path, monkeypatch):
    model = ir.serde.deserialize_model(model_proto())
    destination = tmp_path / "model.kiln"
    write_artifact(destination, model, _manifest(model, "first"))
    before = snapshot(tmp_path)
    monkeypatch.setattr(ir, "save", _no_space)
    with pytest.raises(KilnError, match="No space left on device"):
        write_artifact(destination, model, _manifest(model, "second"))
    assert snapshot(tmp_path) == before


def test_refused_destination_is_untouched_and_checked_before_writing(tmp_path, monkeypatch):
    (tmp_path / "model.kiln").write_text("not a directory\n")
    before = snapshot(tmp_path)
    monkeypatch.setattr(ir, "save", _no_space)  # never reached: refused before writing
    with pytest.raises(KilnError) as info:
        model = ir.serde.deserialize_model(model_proto())
        write_artifact(tmp_path / "model.kiln", model, _manifest(model))
    assert "exists and is not a Kiln artifact; refusing to replace it." in str(info.value)
    assert snapshot(tmp_path) == before


def test_shapes_take_a_named_dims_int_and_refuse_what_is_no_shape() -> None:
    # `--shape seq=32` on the command line; {"seq": 32} from Python means the same.
    assert CompileConfig(shapes={"seq": 32}).shapes == CompileConfig(shapes={"seq": (32,)}).shapes
    with pytest.raises(KilnError, match=r"shapes\['x'\] = 'ab': give sizes"):
        CompileConfig(shapes={"x": "ab"})
