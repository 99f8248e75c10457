"""Where Kiln keeps its state (`KILN_HOME`, default ~/.cache/kiln) and how it writes files there:
atomically, so that a crash, a full disk or two writers never leave half a file."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def kiln_home() -> Path:
    return Path(os.environ.get("KILN_HOME") or Path.home() / ".cache" / "kiln")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary sibling, then rename over `path`: readers see the old file or the
    new one, never a part. Raises OSError; nothing is left behind on failure."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        os.chmod(name, 0o644)  # as open() would make it; mkstemp's 0600 hides reports
        os.replace(name, path)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise


def output_problem(path: Path, directory: bool = False) -> str | None:
    """Why `path` cannot receive what a verb will write there (a file, or with `directory` an
    artifact directory), or None. Checked before the long work, so a bad -o costs nothing: the
    parent must be an existing directory this process can create files in (tried, not
    guessed: permissions, read-only mounts and ACLs all answer), and a file's path must not be
    a directory."""
    path = Path(path)
    parent = path.absolute().parent
    if not parent.exists():
        return f"the directory {parent} does not exist"
    if not parent.is_dir():
        return f"{parent} is not a directory"
    if not directory and path.is_dir():
        return "is a directory; give a file path"
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=parent)
    except OSError as exc:
        return f"cannot write in {parent} ({exc.strerror or exc})"
    os.close(fd)
    Path(probe).unlink(missing_ok=True)
    return None


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_write_json(path: Path, data: Any, indent: int = 2) -> None:
    atomic_write_text(path, json.dumps(data, indent=indent) + "\n")


def write_cache_json(path: Path, data: Any) -> bool:
    """A cache entry written atomically; a cache that cannot be written is skipped (returns
    False): it costs a recomputation next time, nothing else."""
    try:
        atomic_write_json(path, data)
    except OSError:
        return False
    return True


def read_cache_json(path: Path) -> dict[str, Any]:
    """A cache entry, or {} when there is none or it is unreadable."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
