"""What a session learnt about a model file, kept under KILN_HOME/runtime/ so that the next
session of the same file starts from it: the padding verdicts (no check runs again) and the
last bucket set swapped in (an adaptive session starts from it)."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def kiln_home() -> Path:
    return Path(os.environ.get("KILN_HOME") or Path.home() / ".cache" / "kiln")


def record_path(model_path: str, backend: str) -> Path:
    """One record per model file version and engine: a rewritten file gets a new record."""
    file = Path(model_path).resolve()
    stat = file.stat()
    ident = f"{file}|{stat.st_size}|{stat.st_mtime_ns}|{backend}"
    digest = hashlib.sha256(ident.encode()).hexdigest()[:16]
    return kiln_home() / "runtime" / f"{file.parent.name}-{digest}.json"


def load_record(path: Path) -> dict[str, Any]:
    """The record, or {} when there is none or it is unreadable (it is only a cache)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def save_record(path: Path, data: dict[str, Any]) -> None:
    """Write atomically (temp file, then rename): a crash never leaves half a record. A record
    that cannot be written is skipped: it is only a cache."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        tmp = Path(name)
        with os.fdopen(fd, "w") as file:
            json.dump(data, file, indent=1)
        os.replace(tmp, path)
        tmp = None
    except OSError:
        pass
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
