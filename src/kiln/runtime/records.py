"""What a session learnt about a model file, kept under KILN_HOME/runtime/ so that the next
session of the same file starts from it: the padding verdicts (no check runs again) and the
last bucket set swapped in (an adaptive session starts from it)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from kiln.home import kiln_home, read_cache_json, write_cache_json


def record_path(model_path: str, backend: str) -> Path:
    """One record per model file version and engine: a rewritten file gets a new record."""
    file = Path(model_path).resolve()
    stat = file.stat()
    ident = f"{file}|{stat.st_size}|{stat.st_mtime_ns}|{backend}"
    digest = hashlib.sha256(ident.encode()).hexdigest()[:16]
    return kiln_home() / "runtime" / f"{file.parent.name}-{digest}.json"


def load_record(path: Path) -> dict[str, Any]:
    """The record, or {} when there is none or it is unreadable (it is only a cache)."""
    return read_cache_json(path)


def save_record(path: Path, data: dict[str, Any]) -> None:
    """Written atomically; a record that cannot be written is skipped: it is only a cache."""
    write_cache_json(path, data)
