"""Shape buckets: parsing `batch=1,4,8 seq=32,64`, routing a shape to a bucket, and proposing a
better bucket set from the shapes actually seen."""

from __future__ import annotations

import functools
import itertools
import re
from collections import Counter
from collections.abc import Iterable, Mapping

import numpy as np

from kiln.errors import KilnError

Buckets = dict[str, list[int]]
# One executable's shape: (dim name, size) pairs in dim-name order, usable as a dict key.
BucketKey = tuple[tuple[str, int], ...]

_ENTRY = re.compile(r"^([A-Za-z_][\w.:/-]*)=(\d+(?:,\d+)*)$")


def parse_buckets(text: str | Mapping[str, Iterable[int]] | None) -> Buckets:
    """`"batch=1,4,8 seq=32,64"` (spaces or `;` between dims) or a dict, into
    {dim: sorted sizes}. Used by `kiln.Session(buckets=...)` and the CLI's `--buckets`."""
    if text is None:
        return {}
    if isinstance(text, Mapping):
        return _checked({str(k): list(v) for k, v in text.items()}, repr(dict(text)))
    buckets: dict[str, list[int]] = {}
    for entry in re.split(r"[\s;]+", text.strip()):
        if not entry:
            continue
        match = _ENTRY.match(entry)
        if match is None or match[1] in buckets:
            raise KilnError(
                f"--buckets '{text}': bad entry '{entry}'; expected DIM=SIZE,SIZE,... per dim, "
                "e.g. 'batch=1,4,8 seq=32,64'."
            )
        buckets[match[1]] = [int(s) for s in match[2].split(",")]
    return _checked(buckets, text)


def _checked(buckets: dict[str, list[int]], text: str) -> Buckets:
    for dim, sizes in buckets.items():
        if not sizes or any(not isinstance(s, int | np.integer) or s < 1 for s in sizes):
            raise KilnError(
                f"buckets {text}: dim '{dim}' needs one or more positive integer sizes, "
                f"got {list(sizes)}."
            )
    return {dim: sorted({int(s) for s in sizes}) for dim, sizes in buckets.items()}


def format_buckets(buckets: Mapping[str, list[int]]) -> str:
    """The inverse of parse_buckets: `batch=1,4,8 seq=32,64`."""
    return " ".join(f"{d}={','.join(map(str, s))}" for d, s in buckets.items()) or "(none)"


def key_of(sizes: Mapping[str, int]) -> BucketKey:
    return tuple(sorted(sizes.items()))


@functools.lru_cache(maxsize=4096)
def key_text(key: BucketKey | None) -> str:
    """`batch=4,seq=64`; None (the dynamic executable) is `dynamic`. Cached: every bucketed
    request names its bucket, and a bucket set has few keys (no string built per request)."""
    return "dynamic" if key is None else ",".join(f"{d}={s}" for d, s in key)


def all_keys(buckets: Mapping[str, list[int]]) -> list[BucketKey]:
    """Every combination of sizes: one shape-specialised executable each."""
    dims = sorted(buckets)
    return [
        tuple(zip(dims, combo, strict=True))
        for combo in itertools.product(*(buckets[d] for d in dims))
    ]


def route(
    dims: Mapping[str, int], buckets: Mapping[str, list[int]], paddable: Mapping[str, bool]
) -> BucketKey | None:
    """The smallest bucket holding `dims`: per dim the smallest size ≥ the value where padding
    that dim is allowed, the exact value where it is not. None: no bucket holds it (a miss)."""
    target = {}
    for dim, sizes in buckets.items():
        value = dims[dim]
        fits = (
            [s for s in sizes if s >= value] if paddable[dim] else [s for s in sizes if s == value]
        )
        if not fits:
            return None
        target[dim] = fits[0]
    return key_of(target)


def score(
    observed: list[Mapping[str, int]],
    buckets: Mapping[str, list[int]],
    paddable: Mapping[str, bool],
) -> float:
    """Cost of a bucket set on observed shapes: share of misses + mean padding waste per dim
    (a miss runs on the slower dynamic executable; padding computes on zeros)."""
    if not observed:
        return 0.0
    misses, waste = 0, 0.0
    for dims in observed:
        key = route(dims, buckets, paddable)
        if key is None:
            misses += 1
            continue
        waste += sum(1 - dims[d] / s for d, s in key) / max(1, len(key))
    return (misses + waste) / len(observed)


def propose(
    observed: list[Mapping[str, int]],
    dims: Iterable[str],
    paddable: Mapping[str, bool],
    per_dim: int = 4,
) -> Buckets:
    """A bucket set fitted to observed shapes. Paddable dims: sizes at quantiles of the observed
    values (the largest included, so nothing misses); others: the most frequent exact values."""
    out: Buckets = {}
    for dim in dims:
        values = np.array([o[dim] for o in observed if dim in o])
        if values.size == 0:
            continue
        if paddable[dim]:
            qs = np.linspace(0, 1, per_dim + 1)[1:]
            sizes = {int(v) for v in np.quantile(values, qs, method="higher")}
        else:
            sizes = {v for v, _ in Counter(values.tolist()).most_common(per_dim)}
        out[dim] = sorted(sizes)
    return out
