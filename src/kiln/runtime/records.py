"""What a session learnt about a model file, kept under KILN_HOME/runtime/ so that the next
session of the same file starts from it: the padding verdicts (no check runs again) and the
last bucket set swapped in (an adaptive session starts from it)."""

from __future__ import annotations

import hashlib
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kiln.home import kiln_home, read_cache_json, write_cache_json
from kiln.runtime.padding import Verdict


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


def verdicts_json(verdicts: dict[str, Verdict]) -> dict[str, Any]:
    """The padding verdicts as a record keeps them, by dim."""
    out = {d: asdict(v) for d, v in verdicts.items()}
    for v in out.values():
        del v["dim"]
    return out


def recorded_verdicts(record: dict[str, Any]) -> dict[str, Verdict] | None:
    """The padding verdicts an earlier session recorded; None if the record is from another
    Kiln version (then it is ignored and everything is checked again)."""
    try:
        return {d: Verdict(d, **v) for d, v in record.get("padding", {}).items()}
    except (TypeError, AttributeError):
        return None
