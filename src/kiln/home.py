"""Where Kiln keeps its state (`KILN_HOME`, default ~/.cache/kiln) and how it writes files and
directories: atomically, so that a crash, a full disk or two writers never leave half of one."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


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


def replace_directory(
    dest: Path, fill: Callable[[Path], T], after: Callable[[], None] | None = None
) -> T:
    """Build a directory with `fill(tmp)` in a temporary sibling of `dest` (mode 0755, as an
    artifact or a model repository is read by others), then put it in `dest`'s place with
    `move_into_place`. Readers see the old directory or the new one, never a part; on any
    failure (in `fill`, the renames or `after`) what was at `dest` stays and the temporary
    directory goes. Returns what `fill` returns; raises what failed."""
    dest = Path(dest)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.absolute().parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private
        result = fill(tmp)
        move_into_place(tmp, dest, after)
    finally:
        remove_path(tmp)  # gone already when it moved in
    return result


def move_into_place(built: Path, dest: Path, after: Callable[[], None] | None = None) -> None:
    """Rename the directory `built` to `dest` (a sibling). What was at `dest` (a directory, a
    file or a link) is moved aside first and removed only once the new one is in and `after()`
    (a step that belongs to the replacement, e.g. a config beside it) has returned; on any
    failure it is put back and `built` is left where it was, for the caller to remove."""
    dest = Path(dest)
    old = None
    if dest.exists() or dest.is_symlink():
        old = dest.with_name(f".{dest.name}.{secrets.token_hex(4)}.old")
        os.replace(dest, old)
    swapped = False
    try:
        os.replace(built, dest)
        swapped = True
        if after is not None:
            after()
    except BaseException:
        if swapped:
            os.replace(dest, built)
        if old is not None:
            os.replace(old, dest)
        raise
    remove_path(old)


def remove_path(path: Path | None) -> None:
    """Remove what is at `path`, if anything: a directory with its contents (as far as it
    can), a file, or a link (not what it points to). For leftovers: a temporary directory, or
    what a replacement moved aside."""
    if path is None or not (path.exists() or path.is_symlink()):
        return
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


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
