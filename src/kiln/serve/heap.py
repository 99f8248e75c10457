"""Give the C heap's free pages back to the operating system after a large refused request.

A 10 MB JSON request decodes into tens of MB of lists and arrays. Refused, they are freed —
but glibc's malloc keeps the freed pages in the arena of the worker thread that decoded them,
one arena per thread, so a server's resident size climbs by a request's decoded size for each
thread that ever met one, and never comes down. `malloc_trim(0)` hands every arena's whole
free pages back (glibc ≥ 2.8 trims all arenas). Elsewhere (musl, macOS) nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

# Below this, what a refused request leaves is not worth a walk over the heap.
TRIM_ABOVE_BYTES = 1 << 20


@functools.cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc.malloc_trim if libc is not None else None
    except (OSError, AttributeError):  # no glibc: no malloc_trim
        return None


def give_back_free_memory() -> bool:
    """Trim the heap; whether anything could be done (False off glibc)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
