"""The artifact: a directory `NAME.kiln/` with manifest.json, the model, and provenance.json.

It is written into a temporary sibling directory and renamed into place, so a crash, a full
disk or a failed verification never leaves a partial artifact behind.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx_ir as ir

from kiln.artifact.manifest import Manifest
from kiln.artifact.parts import PARTS_DIR, PartsSection, one_part_only, read_parts
from kiln.errors import KilnError, ModelError
from kiln.hardware import cpu_info
from kiln.home import output_problem, replace_directory
from kiln.ir.load import read_checked
from kiln.ir.provenance import ORIGIN_KEY, PASS_KEY, all_nodes, split_origins, trace_of
from kiln.ir.weights import weight_bytes

REBUILD = "Rebuild it with kiln optimize."
MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
# Weights above this size go to the external data file: model.onnx stays small to inspect,
# and ONNX Runtime memory-maps the weights in place rather than holding the parsed file, its
# tensors and their copies: a 64 MiB MLP peaked at 320 MiB inline, 78 MiB external (kiln
# optimize --memory).
EXTERNAL_THRESHOLD = 1 << 20


@dataclass
class Artifact:
    """A compiled model on disk."""

    path: Path
    manifest: Manifest

    @property
    def model_path(self) -> Path:
        return self.path / MODEL_FILE

    def provenance(self) -> dict[str, dict[str, Any]]:
        """Compiled node → {op_type, origin, passes}, as `provenance_map` wrote it."""
        where = self.path / "provenance.json"
        try:
            data = json.loads(where.read_text())
        except FileNotFoundError:
            raise KilnError(
                f"{self.path}: the artifact is missing provenance.json. {REBUILD}"
            ) from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise KilnError(
                f"{where}: corrupted provenance ({_one_line(exc)}). {REBUILD}"
            ) from None
        if not _is_provenance(data):
            raise KilnError(
                f"{where}: corrupted provenance (not a map of compiled nodes). {REBUILD}"
            )
        return data


def _is_provenance(data: Any) -> bool:
    def is_names(value: Any) -> bool:
        return isinstance(value, list) and all(isinstance(n, str) for n in value)

    return isinstance(data, dict) and all(
        isinstance(entry, dict)
        and isinstance(entry.get("op_type"), str)
        and is_names(entry.get("origin"))
        and is_names(entry.get("passes"))
        for entry in data.values()
    )


def provenance_map(model: ir.Model) -> dict[str, dict[str, Any]]:
    """Compiled node name → its op, original nodes and the passes that made it (and, from a
    PyTorch source, `module` and `source`: the modules and file:line it came from)."""
    return {
        node.name or "": {
            "op_type": f"{node.domain}::{node.op_type}" if node.domain else node.op_type,
            "origin": sorted(split_origins(node.metadata_props.get(ORIGIN_KEY, ""))),
            "passes": sorted(split_origins(node.metadata_props.get(PASS_KEY, ""))),
            **trace_of(node),  # a PyTorch source's modules and source lines
        }
        for node in all_nodes(model.graph)
    }


def write_artifact(
    destination: Path, model: ir.Model, manifest: Manifest, force: bool = False
) -> Artifact:
    """Write atomically: everything goes to a temporary sibling, then one rename.

    An existing Kiln artifact at `destination` is replaced; anything else there (a file, a
    directory that is not an artifact, an artifact holding files of the user's) is refused and
    left untouched unless `force`. On any failure nothing is left behind: no partial or
    temporary directory, and what was at `destination` stays there.
    """

    def fill(tmp: Path) -> None:
        if weight_bytes(model) > EXTERNAL_THRESHOLD:
            ir.save(model, tmp / MODEL_FILE, external_data=DATA_FILE)
        else:
            ir.save(model, tmp / MODEL_FILE)
        _write_json(tmp / "provenance.json", provenance_map(model))
        _write_json(tmp / "manifest.json", manifest.to_json())

    _write_atomically(Path(destination), fill, force)
    return Artifact(Path(destination), manifest)


def write_partitioned(
    destination: Path,
    manifest: Manifest,
    provenance: dict[str, dict[str, Any]],
    fill: Callable[[Path], None],
    force: bool = False,
) -> Artifact:
    """A partitioned artifact, written as atomically as `write_artifact`: `fill(directory)`
    writes the parts into the temporary directory (see kiln.artifact.parts)."""

    def write(tmp: Path) -> None:
        fill(tmp)
        _write_json(tmp / "provenance.json", provenance)
        _write_json(tmp / "manifest.json", manifest.to_json())

    _write_atomically(Path(destination), write, force)
    return Artifact(Path(destination), manifest)


def _write_atomically(destination: Path, fill: Callable[[Path], None], force: bool) -> None:
    check_destination(destination, force)

    def write(tmp: Path) -> None:
        fill(tmp)
        _refuse_non_artifact(destination, force)  # it may have changed while we compiled

    try:
        replace_directory(destination, write)
    except OSError as exc:
        raise KilnError(
            f"{destination}: could not write the artifact ({exc.strerror or exc}). Nothing was "
            "written; fix that or choose another -o path."
        ) from None


# What write_artifact puts in an artifact: anything else in one is the user's.
ARTIFACT_FILES = frozenset({"manifest.json", MODEL_FILE, DATA_FILE, "provenance.json", PARTS_DIR})


def check_destination(destination: Path, force: bool = False, source: Any = None) -> Path:
    """Refuse, before any work, a destination that cannot receive an artifact: its directory
    missing or not writable, the model being compiled (`source`, a path) or a directory
    holding it (even with `force`: it would be destroyed before it is read), or something there
    that is not a Kiln artifact of Kiln's own files alone (unless `force`). Return its parent
    directory."""
    destination = Path(destination)
    parent = destination.absolute().parent
    problem = output_problem(destination, directory=True)
    if problem:
        raise KilnError(f"{destination}: {problem}. Nothing was done; choose another -o path.")
    if isinstance(source, str | os.PathLike) and Path(source).exists():
        model, target = Path(source).resolve(), destination.resolve()
        if model == target or target in model.parents:
            raise KilnError(
                f"-o {destination} is (or holds) the model being compiled, {source}: writing "
                "there would destroy it. Choose another -o path."
            )
    _refuse_non_artifact(destination, force)
    return parent


def existing(destination: Path) -> str:
    """What writing to `destination` replaces: "artifact", "directory", "file" or "" (nothing)."""
    destination = Path(destination)
    if (destination / "manifest.json").is_file():
        return "artifact"
    if destination.is_dir() and not destination.is_symlink():
        return "directory"
    return "file" if destination.exists() or destination.is_symlink() else ""


def _refuse_non_artifact(destination: Path, force: bool = False) -> None:
    if force or not (destination.exists() or destination.is_symlink()):
        return
    if destination.is_symlink() or not (destination / "manifest.json").is_file():
        raise KilnError(
            f"{destination}: exists and is not a Kiln artifact; refusing to replace it. "
            "Choose another -o path, remove it first, or pass --force."
        )
    foreign = sorted(p.name for p in destination.iterdir() if p.name not in ARTIFACT_FILES)
    if foreign:
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        shown = ", ".join(foreign[:5]) + more
        raise KilnError(
            f"{destination}: a Kiln artifact that also holds files it did not write ({shown}); "
            "refusing to replace it and lose them. Move them out, choose another -o path, or "
            "pass --force."
        )


def read_artifact(path: str | Path) -> Artifact:
    """Open an artifact directory, checking its format and the hardware it was built for."""
    path = Path(path)
    manifest_path = path / "manifest.json"
    if not manifest_path.is_file():
        raise KilnError(
            f"{path}: not a Kiln artifact (no manifest.json). Build one with kiln optimize."
        )
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise KilnError(
            f"{manifest_path}: corrupted manifest ({_one_line(exc)}). {REBUILD}"
        ) from None
    if not isinstance(manifest, dict):
        raise KilnError(f"{manifest_path}: corrupted manifest. Rebuild it with kiln optimize.")
    if manifest.get("parts"):  # one graph on one engine is what every reader here expects
        raise one_part_only(path, _parts_of(path))
    manifest = Manifest.from_json(manifest, str(manifest_path))
    if not (path / MODEL_FILE).is_file():
        raise KilnError(f"{path}: the artifact is missing {MODEL_FILE}.")
    try:  # the same checks as any model file: a damaged model is one clear line, not a crash
        read_checked(path / MODEL_FILE, str(path / MODEL_FILE))
    except ModelError as exc:  # what is wrong with it, and our own fix: not "re-export"
        raise KilnError(
            f"{exc.problem} The artifact {path} is damaged; rebuild it with kiln optimize."
        ) from None
    if manifest.hardware.fingerprint != cpu_info().fingerprint:
        warnings.warn(
            f"{path} was built on other hardware ({manifest.hardware.cpu}); "
            "it will run, but its tuning may not suit this machine.",
            stacklevel=2,
        )
    return Artifact(path, manifest)


def read_partitioned(path: str | Path) -> tuple[Artifact, PartsSection, dict[str, Artifact]]:
    """Open a partitioned artifact: the whole (its manifest), its parts section, and each part
    opened as `read_artifact` opens an artifact."""
    path = Path(path)
    section = _parts_of(path)
    try:
        data = json.loads((path / "manifest.json").read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise KilnError(
            f"{path}/manifest.json: corrupted manifest ({_one_line(exc)}). {REBUILD}"
        ) from None
    whole = Artifact(path, Manifest.from_json(data, str(path / "manifest.json")))
    parts = {p.name: read_artifact(path / p.path) for p in section.parts}
    return whole, section, parts


def _parts_of(path: Path) -> PartsSection:
    section = read_parts(path)
    if section is None or not section.parts:
        raise KilnError(f"{path}: not a partitioned artifact (no parts in its manifest).")
    return section


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return " ".join(str(exc).split())


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
