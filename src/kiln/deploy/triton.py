"""`export_triton`: an artifact as an entry of a Triton model repository.

    REPO/NAME/config.pbtxt               Triton's ModelConfig (see config.py)
    REPO/NAME/VERSION/model.onnx         native: the artifact's model for Triton's own backend
    REPO/NAME/VERSION/model.py           kiln: Kiln's runtime in Triton's Python backend ...
    REPO/NAME/VERSION/artifact.kiln/     ... serving this copy of the artifact

A partitioned artifact (several parts, each on its own engine) goes only to Kiln's runtime,
which runs it whole as kiln.Session does; Triton's own backends run one graph on one engine.

Everything is checked before anything is written, and written into a temporary directory
beside its place and renamed into it: a failed export leaves the repository as it was.

config.pbtxt is the model's, shared by its versions: a new version whose config would differ
from the one serving the versions already there is refused, naming the fields (`--force`
writes it for every version); one whose config is the same leaves the file as it is.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln import __version__
from kiln.artifact import Artifact, read_artifact
from kiln.artifact.parts import is_partitioned
from kiln.artifact.store import (
    ARTIFACT_FILES,
    DATA_FILE,
    MODEL_FILE,
    read_partitioned,
)
from kiln.deploy.config import KILN, NATIVE, RUNTIMES, triton_backend, triton_config
from kiln.deploy.pbtxt import config_text
from kiln.deploy.triton_pipeline import (
    check_pipeline,
    fill_pipeline,
    pipeline_config,
    pipeline_header,
)
from kiln.errors import KilnError
from kiln.home import atomic_write_text, output_problem, replace_directory
from kiln.pipeline.pipeline_artifact import is_pipeline

CONFIG_FILE = "config.pbtxt"
ARTIFACT_DIR = "artifact.kiln"  # as python_model.ARTIFACT, which cannot import Kiln
_PYTHON_MODEL = Path(__file__).with_name("python_model.py")
# A model name is a directory of the repository and a segment of Triton's URLs.
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
# A top-level field of text format as protobuf prints it: its name at the start of a line.
_TOP_FIELD = re.compile(r"[A-Za-z_]\w*")
_SHOWN = 60  # a differing value longer than this is named, not shown


@dataclass
class TritonExport:
    """What `export_triton` wrote."""

    repository: Path
    name: str
    version: int
    runtime: str  # "native" or "kiln"
    backend: str  # Triton's backend: onnxruntime, openvino, python
    config: dict[str, Any]  # the ModelConfig, as Triton's JSON
    notes: list[str] = field(default_factory=list)  # what Kiln decided that Triton cannot say
    requires: str = ""  # native: the IR version and opsets the backend's engine must read

    @property
    def path(self) -> Path:
        return self.repository / self.name

    @property
    def version_path(self) -> Path:
        return self.path / str(self.version)

    def to_json(self) -> dict[str, Any]:
        return {
            "repository": str(self.repository), "model": self.name, "version": self.version,
            "runtime": self.runtime, "backend": self.backend, "path": str(self.path),
            "config": self.config, "notes": self.notes, "requires": self.requires,
        }  # fmt: skip


def export_triton(
    artifact: str | Path,
    repository: str | Path,
    *,
    name: str | None = None,
    version: int = 1,
    runtime: str = NATIVE,
    force: bool = False,
) -> TritonExport:
    """Write `artifact` into the Triton model repository `repository` as model `name`
    (default: the artifact's name), version `version`: for Triton's own ONNX Runtime or
    OpenVINO backend (`runtime="native"`), or for Kiln's runtime in Triton's Python backend
    (`runtime="kiln"`). An existing non-empty version directory is replaced only with
    `force`. Raises KilnError, writing nothing, on bad input."""
    if runtime not in RUNTIMES:
        raise KilnError(f"unknown runtime '{runtime}'; use {' or '.join(RUNTIMES)}.")
    name = default_name(artifact) if name is None else name
    _check_name(name, given=True)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise KilnError(f"version {version!r}: Triton's versions are whole numbers from 1.")
    if is_pipeline(artifact):  # the user's function over its stages: Kiln's runtime only
        check_pipeline(artifact, runtime)
        backend, config, notes, requires = "python", pipeline_config(name), [], ""
        header = pipeline_header(artifact)

        def fill(into: Path) -> None:
            fill_pipeline(into, artifact)
    else:
        source = read_source(artifact, runtime)
        backend = triton_backend(source.manifest, runtime)
        config, notes, requires = triton_config(source, name, runtime)
        header = _header(source, backend, runtime, notes, requires)

        def fill(into: Path) -> None:
            _fill(into, source, runtime)

    repository = Path(repository)
    _check_destination(repository, name, version, force)
    text = config_text(config, header=header)
    if not _config_to_write(repository / name, version, text, force):
        text = None  # the config serving the other versions serves this one as it is
    _install(repository, name, version, fill, text)
    return TritonExport(repository, name, version, runtime, backend, config, notes, requires)


def read_source(artifact: str | Path, runtime: str) -> Artifact:
    """The artifact to export, opened; a partitioned one (its parts opened too, so a damaged
    part is refused here) only for Kiln's runtime."""
    if not is_partitioned(artifact):
        return read_artifact(artifact)
    whole, section, _ = read_partitioned(artifact)
    if runtime != KILN:
        placed = ", ".join(f"{p.name} on {p.engine}" for p in section.parts)
        raise KilnError(
            f"{artifact} is a partitioned artifact ({placed}): Triton's own backends run one "
            "graph on one engine. Pass --runtime kiln (its model.py runs the parts as "
            f"kiln.Session does), or export one part, e.g. {artifact}/{section.parts[0].path}."
        )
    return whole


def default_name(artifact: str | Path) -> str:
    """The artifact directory's name without `.kiln`, as `kiln serve` names it."""
    stem = Path(str(artifact).rstrip("/")).stem
    _check_name(stem, given=False)
    return stem


def _check_name(name: str, given: bool) -> None:
    if not _NAME.fullmatch(name) or len(name) > 255:
        fix = "choose one" if given else "pass --name"
        raise KilnError(
            f"model name {name!r}: a Triton model name is one directory of the repository: "
            f"letters, digits, '_', '-' and '.', not starting with '.' or '-'; {fix}."
        )


def _check_destination(repository: Path, name: str, version: int, force: bool) -> None:
    """Refuse, before any work, a repository entry that cannot take this export."""
    if repository.exists() and not repository.is_dir():
        raise KilnError(f"{repository}: exists and is not a directory; give a model repository.")
    probe = repository / name if repository.is_dir() else repository
    problem = output_problem(probe, directory=True)
    if problem:
        raise KilnError(f"{probe}: {problem}. Nothing was written.")
    entry = repository / name
    if entry.is_symlink() or (entry.exists() and not entry.is_dir()):
        raise KilnError(f"{entry}: exists and is not a model directory; choose another --name.")
    target = entry / str(version)
    occupied = target.is_symlink() or target.is_file()
    occupied = occupied or (target.is_dir() and any(target.iterdir()))
    if occupied and not force:
        raise KilnError(
            f"{target}: model '{name}' already has version {version}; pass --version with a "
            "new number, or --force to replace it."
        )


def _config_to_write(entry: Path, version: int, text: str, force: bool) -> bool:
    """Whether to write config.pbtxt. It is the model's, not a version's: where other versions
    are served by it, a config that would differ is refused (or, with `force`, written for them
    all) and one that is the same is kept as it is."""
    others = sorted(p.name for p in entry.glob("[0-9]*") if p.name.isdigit()
                    and p.name != str(version))  # fmt: skip
    try:
        existing = (entry / CONFIG_FILE).read_text()
    except (OSError, UnicodeDecodeError):
        return True
    differing = _differing_fields(existing, text)
    if not others or force or not differing:
        return bool(differing)
    served = f"version{'s' * (len(others) > 1)} {', '.join(others)}"
    raise KilnError(
        f"{entry / CONFIG_FILE}: Triton serves every version of model '{entry.name}' with this "
        f"one config, and version {version} would need another; the fields that differ: "
        f"{'; '.join(differing)}. Export this artifact as a model of its own (--name), or pass "
        f"--force to write its config for every version ({served} then run under it)."
    )


def _differing_fields(existing: str, new: str) -> list[str]:
    """The top-level fields in which two config texts differ, each with both values where
    they are short. Comments and whitespace do not count."""
    old_fields, new_fields = _top_fields(existing), _top_fields(new)
    differing = []
    for name in dict.fromkeys([*old_fields, *new_fields]):
        old, new_value = old_fields.get(name, "(none)"), new_fields.get(name, "(none)")
        if old == new_value:
            continue
        old, new_value = _value(name, old), _value(name, new_value)
        shown = len(old) <= _SHOWN and len(new_value) <= _SHOWN
        differing.append(f"{name} ({old} here, {new_value} for this version)" if shown
                         else name)  # fmt: skip
    return differing


def _value(field: str, text: str) -> str:
    """A field's text without its name: `max_batch_size: 8` → `8`."""
    return text.removeprefix(field).removeprefix(":").strip()


def _top_fields(text: str) -> dict[str, str]:
    """Each top-level field of config text as protobuf's text format prints it (a name at
    the start of a line, what belongs to it indented below), its lines joined by spaces."""
    fields: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        start = _TOP_FIELD.match(line)
        if start:
            current = fields.setdefault(start[0], [])
        if current is not None:
            current.append(line.strip())
    return {name: " ".join(lines) for name, lines in fields.items()}


def _header(
    source: Artifact, backend: str, runtime: str, notes: list[str], requires: str
) -> list[str]:
    how = f"Triton's {backend} backend" + (", running Kiln's runtime" if runtime == KILN else "")
    lines = [f"Written by kiln export (kiln {__version__}) from {source.path.resolve()}: {how}."]
    # Triton's image pins its engine, and nothing in the config says what the model needs.
    lines += [f"Requires: {requires}."] if requires else []
    return lines + [f"Note: {note}." for note in notes]


def _fill(into: Path, source: Artifact, runtime: str) -> None:
    """The version directory's files."""
    into.mkdir(exist_ok=True)
    if runtime == NATIVE:
        for file in (MODEL_FILE, DATA_FILE):  # external weights sit beside the model
            if (source.path / file).is_file():
                shutil.copyfile(source.path / file, into / file)
        return
    shutil.copyfile(_PYTHON_MODEL, into / "model.py")
    copy = into / ARTIFACT_DIR
    copy.mkdir()
    for file in sorted(ARTIFACT_FILES):  # Kiln's files only, not what else a user keeps there
        if (source.path / file).is_file():
            shutil.copyfile(source.path / file, copy / file)
        elif (source.path / file).is_dir():  # a partitioned artifact's parts
            shutil.copytree(source.path / file, copy / file)


def _install(
    repository: Path, name: str, version: int, fill: Callable[[Path], None], text: str | None
) -> None:
    """Build the entry (or, when the model exists, the version) beside its place and rename
    it in, with config.pbtxt `text` (None: the model's stays as it is); on any failure
    nothing is left behind and what was there stays."""
    created = not repository.exists()
    try:
        repository.mkdir(exist_ok=True)
        entry = repository / name
        if entry.is_dir():
            _install_version(entry, version, fill, text)
        else:
            _install_entry(entry, version, fill, text)  # new: its config is always written
    except OSError as exc:
        if created:
            shutil.rmtree(repository, ignore_errors=True)
        raise KilnError(
            f"{repository / name}: could not write the Triton model ({exc.strerror or exc}). "
            "Nothing was written."
        ) from None


def _install_entry(entry: Path, version: int, fill: Callable[[Path], None], text: str) -> None:
    def write(tmp: Path) -> None:
        fill(tmp / str(version))
        (tmp / CONFIG_FILE).write_text(text)

    replace_directory(entry, write)


def _install_version(
    entry: Path, version: int, fill: Callable[[Path], None], text: str | None
) -> None:
    """The version directory swapped in whole; the model's config, when it changes, written
    once the version is in (and the old version put back if that write fails)."""

    def config() -> None:
        if text is not None:
            atomic_write_text(entry / CONFIG_FILE, text)

    replace_directory(entry / str(version), fill, after=config)
