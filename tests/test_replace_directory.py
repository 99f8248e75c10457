"""kiln.home.replace_directory: the old directory or the new one, never a part, and nothing
left beside it."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import onnx_ir as ir
import pytest
from test_bad_input import model_proto

from kiln.artifact import BackendInfo, SourceInfo, new_manifest, read_artifact, write_artifact
from kiln.config import CompileConfig
from kiln.errors import KilnError
from kiln.home import move_into_place, replace_directory


def _old(dest: Path) -> None:
    dest.mkdir()
    (dest / "model").write_text("old")


def _leftovers(parent: Path, dest: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p != dest)


def _fill(tmp: Path) -> str:
    (tmp / "model").write_text("new")
    return "filled"


def test_a_new_directory_replaces_the_old_and_nothing_stays_beside_it(tmp_path):
    dest = tmp_path / "out"
    _old(dest)
    assert replace_directory(dest, _fill) == "filled"
    assert (dest / "model").read_text() == "new" and _leftovers(tmp_path, dest) == []
    assert dest.stat().st_mode & 0o777 == 0o755


def test_a_directory_is_made_where_there_was_none(tmp_path):
    replace_directory(tmp_path / "out", _fill)
    assert (tmp_path / "out" / "model").read_text() == "new"


def test_a_failing_fill_leaves_the_old_directory(tmp_path):
    dest = tmp_path / "out"
    _old(dest)

    def fill(tmp: Path) -> None:
        (tmp / "model").write_text("half")
        raise RuntimeError("crash while writing")

    with pytest.raises(RuntimeError, match="crash"):
        replace_directory(dest, fill)
    assert (dest / "model").read_text() == "old" and _leftovers(tmp_path, dest) == []


def test_a_crash_in_the_rename_puts_the_old_directory_back(tmp_path, monkeypatch):
    dest = tmp_path / "out"
    _old(dest)
    real, calls = os.replace, []

    def replace(src, dst):  # the move aside works; the rename of the new one fails
        calls.append((src, dst))
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="No space"):
        replace_directory(dest, _fill)
    assert (dest / "model").read_text() == "old" and _leftovers(tmp_path, dest) == []


def test_a_failing_after_step_takes_the_new_directory_out_again(tmp_path):
    dest = tmp_path / "out"
    _old(dest)

    def after() -> None:
        assert (dest / "model").read_text() == "new"  # it runs with the new one in place
        raise OSError(5, "Input/output error")

    with pytest.raises(OSError, match="Input/output"):
        replace_directory(dest, _fill, after)
    assert (dest / "model").read_text() == "old" and _leftovers(tmp_path, dest) == []


def test_a_file_or_a_link_in_the_way_is_replaced(tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "target").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "target")
    for name in ("file", "link"):
        replace_directory(tmp_path / name, _fill)
        assert (tmp_path / name / "model").read_text() == "new"
        assert not (tmp_path / name).is_symlink()
    assert (tmp_path / "target").is_dir()  # a link is replaced, not what it points to


def test_move_into_place_leaves_what_it_was_given_on_failure(tmp_path):
    built, dest = tmp_path / "built", tmp_path / "dest"
    built.mkdir()
    _old(dest)

    def after() -> None:
        raise OSError("no")

    with pytest.raises(OSError):
        move_into_place(built, dest, after)
    assert built.is_dir() and (dest / "model").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["built", "dest"]


# ------------------------------------------------ the writers that once left no artifact


def _artifact(path: Path, note: str) -> Path:
    model = ir.serde.deserialize_model(model_proto())
    manifest = new_manifest(
        source=SourceInfo("model", note, "0"), model=model, config=CompileConfig(),
        backend=BackendInfo("ort"), passes=[], dropped_passes=[], nodes={},
        precision={"default": "fp32", "nodes": {}}, dims={}, verification=None,
    )  # fmt: skip
    write_artifact(path, model, manifest)
    return path


def _failing_rename_into(dest: Path, monkeypatch) -> None:
    """The first rename whose target is `dest` fails as a full disk would; moving `dest`
    aside, and moving it back, work."""
    failed = []

    def patched(real):
        def rename(src, dst, *args, **kwargs):
            if Path(dst) == dest and not failed:
                failed.append(src)
                raise OSError(28, "No space left on device")
            return real(src, dst, *args, **kwargs)

        return rename

    monkeypatch.setattr(os, "replace", patched(os.replace))
    monkeypatch.setattr(os, "rename", patched(os.rename))


def test_compress_output_survives_a_crash_while_it_is_replaced(tmp_path, monkeypatch):
    from kiln.compress.api import Result, Row, _write_output

    output = _artifact(tmp_path / "best.kiln", "previous")
    (tmp_path / "work").mkdir()
    new = _artifact(tmp_path / "work" / "fp32.kiln", "new")
    row = Row("fp32", "fp32", 0.9, 0.9, params=1, flops=1, artifact=str(new), p50_ms=1.0)
    result = Result("m", "d", batch=1, metric="accuracy", max_drop=0.01, rows=[row])
    _failing_rename_into(output, monkeypatch)
    with pytest.raises(OSError, match="No space"):
        _write_output(result, output, force=True)
    assert read_artifact(output).manifest.source.path == "previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best.kiln", "work"]


def test_split_output_survives_a_crash_while_it_is_replaced(tmp_path, monkeypatch):
    from kiln.split import plan as split

    output = _artifact(tmp_path / "parts", "previous")

    def build_parts(plan, result, tmp, say):
        return _artifact(tmp / "edge", "new"), None

    monkeypatch.setattr(split, "_build_parts", build_parts)
    monkeypatch.setattr(split, "_verify_parts", lambda *a: (SimpleNamespace(ok=True), {}))
    monkeypatch.setattr(split, "_record", lambda *a: None)
    _failing_rename_into(output, monkeypatch)
    with pytest.raises(KilnError, match="could not write the parts"):
        split._write(SimpleNamespace(source="m.onnx"), SimpleNamespace(), output, say=print)
    assert read_artifact(output).manifest.source.path == "previous"
    assert [p.name for p in tmp_path.iterdir()] == ["parts"]
