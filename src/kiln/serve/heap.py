"""Give the C heap's free pages back to the operating system after a large refused request.

A 10 MB JSON request decodes into tens of MB of lists and arrays. Refused, they are freed —
but glibc's malloc keeps the freed pages in the arena of the worker thread that decoded them,
one arena per thread, so a server's resident size climbs by a request's decoded size for each
thread that ever met one, and never comes down. `malloc_trim(0)` hands every arena's whole
free pages back (glibc ≥ 2.8 trims all arenas). Elsewhere (musl, macOS) nothing is done.
"""

from __future__ import annotations

from kiln.backends.release import trim_heap

# Below this, what a refused request leaves is not worth a walk over the heap.
TRIM_ABOVE_BYTES = 1 << 20


def give_back_free_memory() -> bool:
    """Trim the heap; whether any free pages went back (always False off glibc)."""
    return trim_heap()
