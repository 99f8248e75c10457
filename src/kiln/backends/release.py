"""Mapped weight pages an engine has copied, dropped from the process's resident set (Linux).

OpenVINO memory-maps a model's external weights file and compiles from the mapping: its CPU
plugin repacks most weights into memory of its own (at compile, and at the first inference of
each input shape), after which the mapped pages are never read again — but they stay resident,
counted in the process's RSS beside the repacked copy (bert-base fp32: 812 MiB steady for
418 MiB of weights). `release_mapped` gives those pages back with madvise(MADV_DONTNEED).

Only *shared, read-only* mappings of the named files are touched: their pages are clean page
cache, so dropping them is what the kernel itself does under memory pressure — a page read
again is faulted back from the file, unchanged (a weight the engine uses in place, such as
bert-base's embedding table under OpenVINO, comes back on the next run and stays). Private or
writable mappings (libraries, copy-on-write pages) are never advised. The pages leave the
process, not the page cache: the kernel reclaims them when it needs the memory.

`Releasing` runs `release_mapped` every few milliseconds in a thread while a block (a compile,
a first run) reads the mapping, so the peak never holds the whole file beside the copy being
made, and ends with `trim_heap`: the temporaries of a compile or a first run (graph rewrites,
constant folding) are freed into glibc's heap, which keeps them resident until it is asked to
give the free pages back (bert-base int8 under OpenVINO: 11 MiB of its steady 253).
`release_code` does the same for the engine's own libraries: a compile runs code (graph
rewrites, low-precision transformations, kernel generation) that inference never runs again,
and those pages of the library's file stay resident (OpenVINO int8 bert-base: 36 MiB above the
process before the compile, 7 of them needed by inference). It asks the kernel to reclaim them
(madvise(MADV_PAGEOUT), Linux 5.4+): a hint that never changes what memory holds — a clean file
page is dropped and read again from the file on its next use, a written private page (relocated
data) stays, as nothing swaps it — so unlike MADV_DONTNEED it is safe on private mappings. The
price is paid once: the next run faults back the code it uses (OpenVINO int8 bert-base: about
25 ms on a 36 ms run), and so does every other session of the same engine in the process.
`return_frees_above` sets glibc's mallopt thresholds so that large freed blocks leave the
process at once (training's checkpointed activations). This module is Kiln's one door to the C
library's allocator: `trim_heap` and `return_frees_above` are the only malloc calls.
Elsewhere than Linux all are no-ops (`SUPPORTED` is False).
"""

from __future__ import annotations

import ctypes
import functools
import gc
import os
import sys
import threading
from collections.abc import Callable, Collection
from pathlib import Path
from types import TracebackType

SUPPORTED = sys.platform.startswith("linux")
_MADV_DONTNEED = 4
_MADV_PAGEOUT = 21
# The watcher's period: a compile or a first run reads the mapping for 0.1–1 s; one pass over
# /proc/self/maps costs about a millisecond.
INTERVAL_S = 0.01


def release_mapped(paths: Collection[str | os.PathLike[str]]) -> int:
    """Drop this process's resident pages of its shared read-only mappings of `paths`; the
    bytes of mapping advised (0 where nothing is mapped, or elsewhere than Linux)."""
    if not SUPPORTED or not paths:
        return 0
    wanted = {os.path.realpath(p) for p in paths}
    return _advise(lambda perms, path: perms == "r--s" and path in wanted, _MADV_DONTNEED)


def _advise(wanted: Callable[[str, str], bool], advice: int) -> int:
    """madvise(`advice`) on every mapping whose (perms, path) are `wanted`; the bytes advised."""
    try:
        ranges = _ranges(wanted)
    except OSError:
        return 0
    advised = 0
    for start, end in ranges:
        if _madvise()(start, end - start, advice) == 0:
            advised += end - start
    return advised


def _ranges(wanted: Callable[[str, str], bool]) -> list[tuple[int, int]]:
    """Address ranges of the file mappings in /proc/self/maps whose (perms, path) are `wanted`."""
    out = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            # start-end perms offset dev inode [path]; a path may hold spaces
            fields = line.rstrip("\n").split(maxsplit=5)
            if len(fields) < 6 or not wanted(fields[1], fields[5]):
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            out.append((start, end))
    return out


def release_code(libraries: Collection[str | os.PathLike[str]]) -> int:
    """Ask the kernel to reclaim this process's resident pages of the read-only file mappings
    under the folders `libraries` (an engine's shared libraries: code and read-only data); the
    bytes of mapping advised (0 elsewhere than Linux, or on a kernel without MADV_PAGEOUT)."""
    if not SUPPORTED or not libraries:
        return 0
    folders = tuple(os.path.join(os.path.realpath(f), "") for f in libraries)
    return _advise(
        lambda perms, path: perms in _READ_ONLY and path.startswith(folders), _MADV_PAGEOUT
    )


# Private read-only mappings: a library's code (r-xp) and its constants (r--p).
_READ_ONLY = ("r-xp", "r--p")


def trim_heap() -> bool:
    """Give the heap's free pages back to the system (glibc's malloc_trim); False where the C
    library has no such call (musl, elsewhere than Linux). A few milliseconds: called once
    after a compile or a first run, never per request."""
    trim = _malloc_trim()
    return bool(trim is not None and trim(0))


def collect_garbage() -> bool:
    """Free what only reference cycles keep alive, then `trim_heap`. An onnx_ir model is a web
    of cycles (a node names its graph, a value its producer), so a discarded copy — every
    candidate and every accuracy-guard trial of a compile is one, with all its weights — stays
    resident until the collector's rare full pass, and a precision search's memory climbs
    with every trial until then (the onnx-ir note in docs/contributing/engine-notes.md). Tens
    of milliseconds: called between compiles, never per request."""
    gc.collect()
    return trim_heap()


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def return_frees_above(size: int) -> bool:
    """Make glibc return every freed block over `size` bytes to the system: a fixed mmap
    threshold (no dynamic raise, which would keep ever larger blocks on the heap) and the
    trim threshold at the same size. False where the C library has no mallopt (musl,
    elsewhere than Linux), and then nothing is changed."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None) if SUPPORTED else None
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, size)) and bool(mallopt(_M_TRIM_THRESHOLD, size))


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if not SUPPORTED:
        return None
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


@functools.cache
def _madvise() -> Callable[[int, int, int], int]:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise.restype = ctypes.c_int
    return libc.madvise


class Releasing:
    """`with Releasing(paths, libraries): ...`: `release_mapped(paths)` every `INTERVAL_S` in
    a thread while the block runs (the engine must release the GIL while it reads, as
    OpenVINO's compile and infer do), and once more when it ends, then `trim_heap`; then
    `release_code(libraries)`. Nothing at all when both are empty or elsewhere than Linux."""

    def __init__(
        self,
        paths: Collection[str | os.PathLike[str]],
        libraries: Collection[str | os.PathLike[str]] = (),
    ) -> None:
        self.paths = [str(Path(p)) for p in paths] if SUPPORTED else []
        self.libraries = [str(Path(f)) for f in libraries] if SUPPORTED else []
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Releasing:
        if self.paths:
            self._done.clear()
            self._thread = threading.Thread(target=self._watch, name="kiln-release", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        if self._thread is not None:
            self._done.set()
            self._thread.join()
            self._thread = None
            release_mapped(self.paths)
            trim_heap()
        if self.libraries:
            release_code(self.libraries)

    def _watch(self) -> None:
        while not self._done.wait(INTERVAL_S):
            release_mapped(self.paths)
