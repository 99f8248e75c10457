"""The artifact: a directory `NAME.kiln/` with manifest.json (a `Manifest`), the model and
provenance.json, written atomically."""

from kiln.artifact.manifest import (
    FORMAT_VERSION,
    BackendInfo,
    HardwareInfo,
    Manifest,
    PassRecord,
    SourceInfo,
    new_manifest,
    source_path,
)
from kiln.artifact.store import (
    MODEL_FILE,
    Artifact,
    check_destination,
    provenance_map,
    read_artifact,
    write_artifact,
)

__all__ = [
    "FORMAT_VERSION",
    "MODEL_FILE",
    "Artifact",
    "BackendInfo",
    "HardwareInfo",
    "Manifest",
    "PassRecord",
    "SourceInfo",
    "check_destination",
    "new_manifest",
    "provenance_map",
    "read_artifact",
    "source_path",
    "write_artifact",
]
