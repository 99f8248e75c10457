"""A damaged artifact — truncated or garbage model.onnx, a manifest with wrong types, unknown
backend options or missing keys — is one line and exit 2 from every verb that opens it, and a
KilnError from `kiln.Session`; never a traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import kiln
from kiln.ir.inputs import synthesize


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    where = tmp_path_factory.mktemp("good")
    artifact = kiln.compile("zoo:resnet-tiny", where / "r.kiln", rounds=0)
    np.savez(where / "in.npz", **synthesize(kiln.Session(artifact.path).interface))
    return artifact.path


def _truncate(path: Path) -> None:
    data = (path / "model.onnx").read_bytes()
    (path / "model.onnx").write_bytes(data[: len(data) // 3])


def _garbage(path: Path) -> None:
    (path / "model.onnx").write_bytes(bytes(range(256)) * 40)


def _manifest(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        data = json.loads((path / "manifest.json").read_text())
        change(data)
        (path / "manifest.json").write_text(json.dumps(data))

    return damage


DAMAGES = {
    "truncated model": (_truncate, "is not a valid ONNX model"),
    "garbage model": (_garbage, "is not a valid ONNX model"),
    "unknown option": (
        _manifest(lambda d: d["backend"]["options"].update(bogus=1)),
        "options are not valid",
    ),
    "unknown backend": (
        _manifest(lambda d: d["backend"].update(name="tensorrt")),
        "names backend 'tensorrt'",
    ),
    "missing key": (_manifest(lambda d: d.pop("source")), "corrupted manifest"),
    "wrong type": (_manifest(lambda d: d.update(nodes="many")), "corrupted manifest"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_artifact_is_one_line_everywhere(good, damage, tmp_path):
    spoil, message = DAMAGES[damage]
    artifact = tmp_path / "r.kiln"
    shutil.copytree(good, artifact)
    spoil(artifact)
    with pytest.raises(kiln.KilnError, match=message):
        kiln.Session(artifact)
    inputs = good.parent / "in.npz"
    for verb in (
        ["run", str(artifact), "--inputs", str(inputs), "-o", str(tmp_path / "out.npz")],
        ["profile", str(artifact), "--runs", "1", "--rounds", "1"],
        ["bench", str(artifact), "--runs", "1", "--rounds", "1"],
        ["compare", str(artifact), str(artifact)],
    ):
        result = subprocess.run(
            [sys.executable, "-m", "kiln", *verb], capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 2, (verb, result.stderr)
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (verb, result.stderr)
    assert not (tmp_path / "out.npz").exists()
