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
from kiln.ir.load import MAX_OPSET

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
        kiln.compile("model.onnx")
    assert str(info.value) == CASES[name].message
    assert snapshot(tmp_path) == before


def test_api_missing_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(KilnError) as info:
        kiln.compile("missing.onnx")
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
