"""A model repository in Triton's layout: `ROOT/NAME/VERSION/`, VERSION a positive integer
folder holding a Kiln artifact (`manifest.json`, the model, provenance) or a plain `model.onnx`;
what `kiln export --triton` writes is served too.

The highest version is the one served. A version policy (Triton's `version_policy` in a
`config.pbtxt`, or anything in a `config.json`) is not read: a model whose folder has one is
said once to be served at its highest version regardless. Folders whose name is not a positive
integer are ignored, as Triton ignores them, and said once each; so are hidden folders.

The repository is read afresh at each look (`names`, `latest`): a version copied in while the
server runs is what the next load serves.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kiln.errors import KilnError

log = logging.getLogger("uvicorn.error")  # configured by uvicorn, so it reaches the console
# Where `kiln export --triton --runtime kiln` puts the artifact in a version folder.
KILN_RUNTIME_ARTIFACT = "artifact.kiln"


@dataclass(frozen=True)
class Version:
    """One version folder of a model in the repository."""

    name: str
    number: int
    path: Path

    @property
    def version(self) -> str:
        return str(self.number)

    @property
    def source(self) -> str:
        """What a `kiln.Session` opens: the version folder as an artifact; else the artifact
        `kiln export --triton --runtime kiln` puts beside its model.py; else its model.onnx
        (what a native export, or any Triton ONNX model, holds)."""
        for artifact in (self.path, self.path / KILN_RUNTIME_ARTIFACT):
            if (artifact / "manifest.json").is_file():
                return str(artifact)
        if (self.path / "model.onnx").is_file():
            return str(self.path / "model.onnx")
        raise KilnError(
            f"{self.path}: holds neither a Kiln artifact (manifest.json) nor a model.onnx; put "
            "one there (kiln optimize MODEL -o that folder) or remove the folder"
        )


class Repository:
    """The repository at `root`; `say` hears each ignored folder and unread policy once."""

    def __init__(self, root: str | Path, say: Callable[[str], None] | None = None) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise KilnError(
                f"--model-repository {root}: no such directory; give a folder laid out as "
                "Triton's, NAME/VERSION/ holding an artifact or a model.onnx"
            )
        self._say = say or log.warning
        self._said: set[str] = set()

    def names(self) -> list[str]:
        """Every model folder's name, sorted."""
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and _shown(p.name))

    def has(self, name: str) -> bool:
        """Whether `name` is a model folder of the repository (not a path out of it)."""
        plain = _shown(name) and "/" not in name and "\\" not in name
        return plain and (self.root / name).is_dir()

    def latest(self, name: str) -> Version:
        """The highest version of model `name`; KilnError naming what is missing."""
        folder = self.root / name
        if not self.has(name):
            listed = ", ".join(f"'{n}'" for n in self.names()) or "none"
            raise KilnError(
                f"no model '{name}' in the repository {self.root} (its models: {listed})"
            )
        self._note_policy(folder)
        versions = self._versions(folder)
        if not versions:
            raise KilnError(
                f"{folder}: no version folder; put the model in {folder}/1/ (an artifact or a "
                "model.onnx), as Triton's layout has it"
            )
        return max(versions, key=lambda v: v.number)

    def _versions(self, folder: Path) -> list[Version]:
        versions = []
        for path in folder.iterdir():
            if not path.is_dir() or not _shown(path.name):
                continue
            number = _positive(path.name)
            if number is None:
                self._once(
                    str(path),
                    f"{path}: ignored, a version folder is named by a positive integer (1, 2, …)",
                )
                continue
            versions.append(Version(folder.name, number, path))
        return versions

    def _note_policy(self, folder: Path) -> None:
        config = folder / "config.pbtxt"
        policy = config.is_file() and "version_policy" in config.read_text(errors="replace")
        if policy or (folder / "config.json").is_file():
            self._once(
                f"{folder}:policy",
                f"{folder}: its version policy is not read; kiln serve serves the highest version",
            )

    def _once(self, key: str, message: str) -> None:
        if key not in self._said:
            self._said.add(key)
            self._say(message)


def _shown(name: str) -> bool:
    return bool(name) and not name.startswith(".")


def _positive(name: str) -> int | None:
    # ASCII digits only: str.isdigit() also takes '²', which int() refuses.
    if name.isascii() and name.isdigit() and int(name) > 0:
        return int(name)
    return None
