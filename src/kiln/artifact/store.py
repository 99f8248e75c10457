"""The artifact: a directory `NAME.kiln/` with manifest.json, the model, and provenance.json.

It is written into a temporary sibling directory and renamed into place, so a crash, a full
disk or a failed verification never leaves a partial artifact behind.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import onnx_ir as ir

from kiln.artifact.manifest import Manifest
from kiln.errors import KilnError
from kiln.hardware import cpu_info
from kiln.ir.load import resolve_source
from kiln.ir.provenance import ORIGIN_KEY, PASS_KEY, all_nodes, split_origins

MODEL_FILE = "model.onnx"
DATA_FILE = "model.onnx.data"
# Weights above this size go to the external data file, keeping model.onnx small to inspect.
EXTERNAL_THRESHOLD = 1 << 26


@dataclass
class Artifact:
    """A compiled model on disk."""

    path: Path
    manifest: Manifest

    @property
    def model_path(self) -> Path:
        return self.path / MODEL_FILE

    def provenance(self) -> dict[str, Any]:
        return json.loads((self.path / "provenance.json").read_text())


def provenance_map(model: ir.Model) -> dict[str, dict[str, Any]]:
    """Compiled node name → its op, original nodes and the passes that made it."""
    return {
        node.name or "": {
            "op_type": f"{node.domain}::{node.op_type}" if node.domain else node.op_type,
            "origin": sorted(split_origins(node.metadata_props.get(ORIGIN_KEY, ""))),
            "passes": sorted(split_origins(node.metadata_props.get(PASS_KEY, ""))),
        }
        for node in all_nodes(model.graph)
    }


def write_artifact(destination: Path, model: ir.Model, manifest: Manifest) -> Artifact:
    """Write atomically: everything goes to a temporary sibling, then one rename.

    An existing artifact at `destination` is replaced; anything else there is refused and left
    untouched. On any failure nothing is left behind: no partial or temporary directory.
    """
    destination = Path(destination)
    parent = check_destination(destination)
    tmp = old = None
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{destination.name}.", dir=parent))
        tmp.chmod(0o755)  # mkdtemp makes it private; an artifact is meant to be shared
        size = sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value)
        if size > EXTERNAL_THRESHOLD:
            ir.save(model, tmp / MODEL_FILE, external_data=DATA_FILE)
        else:
            ir.save(model, tmp / MODEL_FILE)
        _write_json(tmp / "provenance.json", provenance_map(model))
        _write_json(tmp / "manifest.json", manifest.to_json())
        _refuse_non_artifact(destination)
        if destination.exists():
            # Move the old artifact aside first, so a failed rename can put it back.
            old = tmp.with_name(tmp.name + ".old")
            destination.rename(old)
            try:
                tmp.rename(destination)
            except OSError:
                old.rename(destination)
                old = None
                raise
        else:
            tmp.rename(destination)
    except OSError as exc:
        raise KilnError(
            f"{destination}: could not write the artifact ({exc.strerror or exc}). Nothing was "
            "written; fix that or choose another -o path."
        ) from None
    finally:
        for leftover in (tmp, old):
            if leftover is not None and leftover.exists():
                shutil.rmtree(leftover, ignore_errors=True)
    return Artifact(destination, manifest)


def check_destination(destination: Path) -> Path:
    """Refuse, before any work, a destination that cannot receive an artifact; return its
    parent directory."""
    parent = destination.absolute().parent
    if not parent.is_dir():
        raise KilnError(
            f"{destination}: the directory {parent} does not exist. Create it or choose "
            "another -o path."
        )
    _refuse_non_artifact(destination)
    return parent


def _refuse_non_artifact(destination: Path) -> None:
    if destination.exists() and not (destination / "manifest.json").is_file():
        raise KilnError(
            f"{destination}: exists and is not a Kiln artifact; refusing to replace it. "
            "Choose another -o path or remove it first."
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
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise KilnError(
            f"{manifest_path}: corrupted manifest ({exc}). Rebuild it with kiln optimize."
        ) from None
    if not isinstance(manifest, dict):
        raise KilnError(f"{manifest_path}: corrupted manifest. Rebuild it with kiln optimize.")
    manifest = Manifest.from_json(manifest, str(manifest_path))
    if not (path / MODEL_FILE).is_file():
        raise KilnError(f"{path}: the artifact is missing {MODEL_FILE}.")
    try:  # the same checks as any model file: truncated or garbage bytes are one clear line
        resolve_source(str(path / MODEL_FILE))
    except KilnError as exc:
        raise KilnError(
            f"{exc} The artifact {path} is damaged; rebuild it with kiln optimize."
        ) from None
    if manifest.hardware.fingerprint != cpu_info().fingerprint:
        warnings.warn(
            f"{path} was built on other hardware ({manifest.hardware.cpu}); "
            "it will run, but its tuning may not suit this machine.",
            stacklevel=2,
        )
    return Artifact(path, manifest)


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
