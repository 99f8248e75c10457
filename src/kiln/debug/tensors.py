"""One tensor as the debugger shows it: shape, dtype, statistics, a histogram and a slice.

The statistics are numpy's own on the array as the engine returned it (`a.mean()`, `a.std()`,
not on a float64 copy), so they equal what a user computes on the same tensor. JSON has no
NaN or infinity: such a value is sent as the text "nan", "inf" or "-inf".
"""

from __future__ import annotations

import io
import math
import re
import zipfile
from typing import Any

import numpy as np

from kiln.errors import KilnError

BINS = 32
MAX_VALUES = 1000
_INDEX_PART = re.compile(r"^(-?\d+)?(:(-?\d+)?(:(-?\d+)?)?)?$")


def number(value: Any) -> float | str:
    """A float for JSON: finite as is, else its text."""
    value = float(value)
    return value if math.isfinite(value) else str(value)


def _numeric(array: np.ndarray) -> np.ndarray | None:
    """The array numpy computes statistics on directly; other float types (bfloat16 from
    ml_dtypes) as float32; None for text and objects."""
    if array.dtype.kind in "biuf":
        return array
    try:
        return array.astype(np.float32)
    except (TypeError, ValueError):
        return None


def stats(array: np.ndarray) -> dict[str, Any]:
    """min, max, mean, std as numpy computes them, and how many values are not finite."""
    values = _numeric(array)
    if values is None or values.size == 0:
        return {}
    out = {
        "min": number(values.min()),
        "max": number(values.max()),
        "mean": number(values.mean()),
        "std": number(values.std()),
    }
    if values.dtype.kind == "f":
        out["nan"] = int(np.isnan(values).sum())
        out["inf"] = int(np.isinf(values).sum())
    return out


def histogram(array: np.ndarray, bins: int = BINS) -> dict[str, Any] | None:
    """Counts of the finite values in `bins` equal bins between their min and max."""
    values = _numeric(array)
    if values is None or values.size == 0:
        return None
    flat = values.reshape(-1).astype(np.float64)
    flat = flat[np.isfinite(flat)]
    if flat.size == 0:
        return None
    counts, edges = np.histogram(flat, bins=bins)
    return {"counts": counts.tolist(), "edges": edges.tolist()}


def default_index(shape: tuple[int, ...]) -> str:
    """The last axis of the first row: `0,0,:` for a (1, 16, 64) tensor."""
    if not shape:
        return ""
    return ",".join(["0"] * (len(shape) - 1) + [":"])


def parse_index(text: str) -> tuple[Any, ...]:
    """numpy's basic indexing written as text: `0,:,2:8`, `...,-1`."""
    parts: list[Any] = []
    for raw in text.split(","):
        part = raw.strip()
        if part == "...":
            parts.append(Ellipsis)
            continue
        match = _INDEX_PART.match(part)
        if match is None:
            raise KilnError(
                f"index '{text}': use integers, slices and '...' as in numpy, e.g. 0,:,:8."
            )
        if ":" not in part:
            if not part:
                parts.append(slice(None))
                continue
            parts.append(int(part))
            continue
        bounds = [int(p) if p else None for p in part.split(":")]
        parts.append(slice(*bounds))
    return tuple(parts)


def values(array: np.ndarray, index: str | None) -> dict[str, Any]:
    """The values at `index` (default: `default_index`), at most MAX_VALUES of them."""
    text = default_index(array.shape) if index is None else index.strip()
    try:
        picked = np.asarray(array[parse_index(text)] if text else array)
    except IndexError as exc:
        raise KilnError(f"index '{text}' does not fit shape {list(array.shape)}: {exc}.") from None
    flat = picked.reshape(-1)
    shown = flat[:MAX_VALUES]
    if picked.dtype.kind in "biuf":
        listed = [number(v) if picked.dtype.kind == "f" else int(v) for v in shown.tolist()]
    else:
        listed = [str(v) for v in shown.tolist()]
    return {
        "index": text,
        "shape": list(picked.shape),
        "values": listed,
        "truncated": flat.size > MAX_VALUES,
    }


def tensor_json(name: str, array: Any, index: str | None = None) -> dict[str, Any]:
    """Everything the tensor panel shows about one array."""
    data = np.asarray(array)
    return {
        "name": name,
        "shape": list(data.shape),
        "dtype": str(data.dtype),
        "size": int(data.size),
        "stats": stats(data),
        "histogram": histogram(data),
        "slice": values(data, index),
    }


def to_npy(array: Any) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, np.asarray(array), allow_pickle=False)
    return buffer.getvalue()


NPY_MAGIC = b"\x93NUMPY"
EXPECTED = (
    "expected an .npz (numpy.savez) of one array per input, or an .npy (numpy.save) of one "
    "array, of numbers or text; pickled objects are not loaded"
)


def read_arrays(body: bytes, name: str | None = None) -> dict[str, np.ndarray]:
    """An uploaded .npz (one array per input) or .npy (the array of input `name`), told apart
    by their first bytes: anything else is refused as what it is, never handed to numpy's
    loader (which takes unknown bytes for a pickle)."""
    buffer = io.BytesIO(body)
    is_npz = zipfile.is_zipfile(buffer)
    if not is_npz and not body.startswith(NPY_MAGIC):
        raise KilnError(f"the upload is neither an .npz nor an .npy file: {EXPECTED}.")
    buffer.seek(0)
    try:
        if is_npz:
            with np.load(buffer, allow_pickle=False) as archive:
                return {key: archive[key] for key in archive.files}
        array = np.load(buffer, allow_pickle=False)
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        what = "holds a pickled object array" if "allow_pickle" in str(exc) else "is unreadable"
        raise KilnError(
            f"the uploaded {'.npz' if is_npz else '.npy'} {what}: {EXPECTED}."
        ) from None
    if name is None:
        raise KilnError("an .npy holds one array: say which input it is (PUT /api/inputs/NAME).")
    return {name: array}
