"""The pipeline artifact: a directory that runs and serves elsewhere.

    OUT.kiln/
      pipeline.json      the function (module file, name, source SHA-256), each stage's
                         source, chosen precision and artifact, the metric with the reference
                         and final figures, the reference run's times and shapes, and the
                         search: every end-to-end trial with its metric and the stage's time
      <module>.py        the function's module file, as it was compiled
      stages/NAME.kiln   each stage's verified artifact (kiln.compile), its files' SHA-256 in
                         pipeline.json, checked at load as the module's is

Written whole or not at all (kiln.home.replace_directory).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kiln import __version__
from kiln.errors import KilnError
from kiln.home import replace_directory
from kiln.pipeline.function import (
    PipelineFunction,
    check_models,
    load_function,
    source_hash,
)

FORMAT = "kiln-pipeline"
VERSION = 1
MANIFEST = "pipeline.json"


def write_pipeline(
    output: Path, fn: PipelineFunction, stages: Mapping[str, Any], record: dict[str, Any]
) -> Path:
    """Write the artifact at `output` from the stages' chosen candidates; its path."""
    module_file = Path(inspect.getsourcefile(fn) or "")
    if not module_file.is_file():
        raise KilnError(
            f"{fn.__qualname__}: its source file cannot be found; a pipeline artifact keeps "
            "the function's module file, so define it in a .py file."
        )
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "kiln_version": __version__,
        "function": {"module_file": module_file.name, "name": fn.__name__,
                     "source_sha256": source_hash(fn), "compiled_from": str(module_file)},
        "stages": {
            name: {"source": s.source, "precision": s.choice,
                   "engine": _engine(s.candidates[s.choice]), "artifact": f"stages/{name}.kiln"}
            for name, s in stages.items()
        },
        **record,
    }  # fmt: skip

    def fill(tmp: Path) -> None:
        shutil.copy2(module_file, tmp / module_file.name)
        (tmp / "stages").mkdir()
        for name, stage in stages.items():
            shutil.copytree(stage.candidates[stage.choice], tmp / "stages" / f"{name}.kiln")
            manifest["stages"][name]["sha256"] = _digest(tmp / "stages" / f"{name}.kiln")
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")

    replace_directory(Path(output), fill)
    return Path(output)


def _engine(artifact: str | Path) -> str:
    """The engine a stage's artifact runs on, from its manifest."""
    manifest = json.loads((Path(artifact) / "manifest.json").read_text())
    return str(manifest.get("config", {}).get("engine", ""))


def _digest(folder: Path) -> str:
    """SHA-256 over every file of a stage's artifact (each name and its file's SHA-256, in
    name order): what the stage was verified as, so that a model changed since is noticed."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        with path.open("rb") as file:
            own = hashlib.file_digest(file, "sha256").digest()
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0" + own)
    return digest.hexdigest()


def _check_stages(stages: dict[str, Path], manifest: dict[str, Any]) -> None:
    for name, folder in stages.items():
        recorded = manifest["stages"][name].get("sha256")
        if recorded is not None and folder.is_dir() and _digest(folder) != recorded:
            raise KilnError(
                f"{folder} changed after the compile (its SHA-256 is not the one {MANIFEST} "
                "records): the stage was verified as compiled. Compile the pipeline again."
            )


def is_pipeline(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def read_pipeline(path: str | Path) -> tuple[PipelineFunction, dict[str, Path], dict[str, Any]]:
    """The function, the stages' artifact paths and the manifest of the artifact at `path`."""
    root = Path(path)
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise KilnError(f"{root}: not a readable pipeline artifact ({exc}).") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise KilnError(f"{root}: {MANIFEST} is not a kiln pipeline of format version {VERSION}.")
    function = manifest["function"]
    fn = load_function(f"{root / function['module_file']}:{function['name']}")
    recorded = function.get("source_sha256")
    if recorded is not None and source_hash(fn) != recorded:
        raise KilnError(
            f"{root / function['module_file']} changed after the compile (its SHA-256 is not "
            f"the one {MANIFEST} records): the stages' choices were judged on the function as "
            "compiled. Restore the file, or compile the pipeline again."
        )
    stages = {name: root / s["artifact"] for name, s in manifest["stages"].items()}
    _check_stages(stages, manifest)
    try:
        check_models(fn, list(stages), "")
    except KilnError:
        raise KilnError(
            f"{root / MANIFEST}: its stages ({', '.join(stages) or 'none'}) are not the models "
            f"{function['name']} takes: the artifact is damaged; compile the pipeline again."
        ) from None
    return fn, stages, manifest
