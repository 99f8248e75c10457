"""The KServe v2 (Open Inference Protocol) wire format: tensors as `kiln serve` reads and writes
them over HTTP (serve/protocol.py) and gRPC (serve/grpc_service.py), and as a remote session
sends and reads them (runtime/remote.py). Only numpy: every layer above may use it.

A tensor is a JSON object {name, datatype, shape} with its values in `data` (JSON, flattened in
row-major order) or, in the binary tensor extension that Triton's clients speak, raw after the
JSON header (`parameters.binary_data_size` bytes each, in the header's order; the header is
`Inference-Header-Content-Length` bytes long). gRPC's raw contents are laid out the same way;
its typed `contents` fields are the other way in (CONTENTS_FIELDS).

BYTES tensors (ONNX strings) are JSON strings in `data`; raw, each element is a 4-byte
little-endian length and its bytes, as tritonclient's `serialize_byte_tensor` writes them. The
engines take ONNX strings as Python str, so elements must be UTF-8 text.

Everything here is parsed as untrusted input: a tensor the protocol cannot take raises
`ProtocolError` naming what is wrong, whatever the bytes, never another exception.
"""

from __future__ import annotations

import math
import reprlib
import struct
from collections.abc import Collection, Iterator
from typing import Any

import numpy as np

# KServe datatype ↔ numpy, for fixed-size elements. BF16 is left out (numpy has no bfloat16), so
# it is refused with a message rather than half-supported.
DATATYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_),
    "UINT8": np.dtype(np.uint8),
    "UINT16": np.dtype(np.uint16),
    "UINT32": np.dtype(np.uint32),
    "UINT64": np.dtype(np.uint64),
    "INT8": np.dtype(np.int8),
    "INT16": np.dtype(np.int16),
    "INT32": np.dtype(np.int32),
    "INT64": np.dtype(np.int64),
    "FP16": np.dtype(np.float16),
    "FP32": np.dtype(np.float32),
    "FP64": np.dtype(np.float64),
}
BYTES = "BYTES"  # variable-length elements: numpy object arrays of str
HEADER_LENGTH = "Inference-Header-Content-Length"  # the binary extension's HTTP header
# gRPC's typed InferTensorContents field for each datatype, and the numpy type that field
# holds. FP16 has none: it travels raw only.
CONTENTS_FIELDS: dict[str, tuple[str, np.dtype | None]] = {
    "BOOL": ("bool_contents", np.dtype(np.bool_)),
    "INT8": ("int_contents", np.dtype(np.int32)),
    "INT16": ("int_contents", np.dtype(np.int32)),
    "INT32": ("int_contents", np.dtype(np.int32)),
    "INT64": ("int64_contents", np.dtype(np.int64)),
    "UINT8": ("uint_contents", np.dtype(np.uint32)),
    "UINT16": ("uint_contents", np.dtype(np.uint32)),
    "UINT32": ("uint_contents", np.dtype(np.uint32)),
    "UINT64": ("uint64_contents", np.dtype(np.uint64)),
    "FP32": ("fp32_contents", np.dtype(np.float32)),
    "FP64": ("fp64_contents", np.dtype(np.float64)),
    BYTES: ("bytes_contents", None),
}
_BY_NUMPY = {dtype: name for name, dtype in DATATYPES.items()}
# ONNX element types (onnx_ir DataType names) under their KServe v2 names.
KSERVE_TYPES = {
    "FLOAT": "FP32", "FLOAT16": "FP16", "DOUBLE": "FP64", "BFLOAT16": "BF16", "BOOL": "BOOL",
    "STRING": "BYTES", "INT8": "INT8", "INT16": "INT16", "INT32": "INT32", "INT64": "INT64",
    "UINT8": "UINT8", "UINT16": "UINT16", "UINT32": "UINT32", "UINT64": "UINT64",
}  # fmt: skip
# The JSON values each kind of element takes (bool is not an int here, as in Triton).
_JSON_KINDS: dict[str, tuple[tuple[type, ...], str]] = {
    "b": ((bool,), "true/false"),
    "i": ((int,), "JSON integers"),
    "u": ((int,), "JSON integers"),
    "f": ((int, float), "JSON numbers"),
}
_ALL_RIGHT = object()  # no value of the wrong kind was found
MAX_RANK = 32  # numpy stops at 64; no model takes tensors of more than a few dims
_MAX_DIM = 2**63 - 1  # KServe shapes are int64


class ProtocolError(Exception):
    """A message the protocol cannot accept; a server answers it with HTTP 400."""


def datatype_of(value: np.ndarray | np.dtype | str) -> str:
    """The KServe datatype of a numpy array or dtype (text and object arrays are BYTES)."""
    dtype = value.dtype if isinstance(value, np.ndarray) else np.dtype(value)
    if dtype.kind in "OUS":
        return BYTES
    try:
        return _BY_NUMPY[dtype]
    except KeyError:
        raise ProtocolError(f"tensors of numpy dtype {dtype} cannot be sent") from None


def clip(value: Any) -> str:
    """A short repr of what the client sent, for error messages: it may be megabytes, or
    nested deeper than repr() can go."""
    return _CLIP.repr(value)


def _clipper() -> reprlib.Repr:
    short = reprlib.Repr()  # keyword arguments only from Python 3.12
    short.maxlevel, short.maxlist, short.maxdict = 3, 8, 4
    short.maxstring, short.maxlong, short.maxother = 60, 40, 60
    return short


_CLIP = _clipper()


def header_length(value: str | None) -> int | None:
    """The `Inference-Header-Content-Length` header as a byte count (None when absent)."""
    if value is None:
        return None
    text = value.strip()
    # ASCII digits only: str.isdigit() also takes '²', which int() refuses.
    if not (text.isascii() and text.isdigit() and len(text) <= 18):
        raise ProtocolError(
            f"Inference-Header-Content-Length must be a byte count, got {clip(value)}"
        )
    return int(text)


def parameters_of(obj: dict[str, Any], where: str) -> dict[str, Any]:
    """The `parameters` object of a message or tensor ({} when absent)."""
    params = obj.get("parameters") or {}
    if not isinstance(params, dict):
        raise ProtocolError(f"'parameters' of the {where} must be a JSON object")
    return params


def check_name(name: str, names: Collection[str] | None) -> None:
    """Refuse an input that is not one of `names` (a model's inputs; None: any), before its
    data is read: the data of a tensor the model does not take means nothing, and its errors
    would hide the wrong name."""
    if names is not None and name not in names:
        raise ProtocolError(unknown_input(name, names))


def unknown_input(name: str, names: Collection[str]) -> str:
    return f"unknown input {clip(name)}; the model's inputs are {sorted(names)}"


def check_datatype(where: str, datatype: Any) -> str:
    """A datatype the protocol carries: one of DATATYPES, or BYTES."""
    if datatype != BYTES and (not isinstance(datatype, str) or datatype not in DATATYPES):
        known = ", ".join([*DATATYPES, BYTES])
        raise ProtocolError(f"{where}: unsupported datatype {clip(datatype)}; use {known}")
    return datatype


def check_shape(where: str, shape: Any) -> list[int]:
    """A tensor's shape as the protocol takes it (HTTP's JSON list, gRPC's int64s): dims from
    0 to int64's largest, at most MAX_RANK of them."""
    # type() is int, not isinstance: true and false are not dims.
    if not isinstance(shape, list) or not all(type(d) is int and 0 <= d <= _MAX_DIM for d in shape):
        raise ProtocolError(
            f"{where}: 'shape' must be a list of non-negative integers, got {clip(shape)}"
        )
    if len(shape) > MAX_RANK:
        raise ProtocolError(f"{where}: shape has {len(shape)} dims; at most {MAX_RANK} are taken")
    return shape


def shaped(where: str, values: np.ndarray, shape: list[int]) -> np.ndarray:
    """The flat `values` as a tensor of `shape`, which must hold exactly as many."""
    count = math.prod(shape)  # a Python int: a lying shape cannot overflow it
    if values.size != count:
        raise ProtocolError(
            f"{where}: shape {shape} needs {count} values, the data has {values.size}"
        )
    try:
        return values.reshape(shape)
    except ValueError as exc:  # an empty tensor whose other dims overflow numpy's sizes
        raise ProtocolError(f"{where}: shape {shape} cannot be a tensor ({exc})") from None


# ---------------------------------------------------------------- decoding


def decode_tensor(
    spec: Any, blob: memoryview, kind: str = "input", names: Collection[str] | None = None
) -> tuple[np.ndarray, int]:
    """One JSON tensor (an input of a request, an output of an answer) with its values in
    `data` or at the start of `blob` (the binary data not yet claimed), and how many bytes of
    `blob` it used; an input not among `names` (see `check_name`) is refused first."""
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ProtocolError(f"each {kind} must be a JSON object with a 'name'")
    check_name(spec["name"], names)
    where = f"{kind} {clip(spec['name'])}"
    datatype = check_datatype(where, spec.get("datatype"))
    shape = check_shape(where, spec.get("shape"))
    size = parameters_of(spec, where).get("binary_data_size")
    if size is not None:
        if type(size) is not int or not 0 <= size <= len(blob):
            raise ProtocolError(
                f"{where}: binary_data_size must be a byte count within the {len(blob)} bytes "
                f"of binary data left in the body, got {clip(size)}"
            )
        # A copy: the body buffer is released when the message is done, the array lives on.
        values = from_raw(where, datatype, shape, blob[:size], "binary_data_size", copy=True)
    elif "data" in spec:
        if datatype == BYTES:
            values = _bytes_from_json(where, spec["data"])
        else:
            values = _numbers_from_json(where, datatype, spec["data"])
        size = 0
    else:
        raise ProtocolError(f"{where} has neither 'data' nor binary_data_size")
    return shaped(where, values, shape), size


def from_raw(
    where: str, datatype: str, shape: list[int], raw: bytes | memoryview, field: str, copy: bool
) -> np.ndarray:
    """A raw tensor, flat: row-major elements, or length-prefixed BYTES elements. Without
    `copy`, a read-only view of `raw` (the engines only read their inputs)."""
    count = math.prod(shape)
    if datatype == BYTES:
        return bytes_from_binary(where, memoryview(raw), count)
    dtype = DATATYPES[datatype]
    if len(raw) != count * dtype.itemsize:
        raise ProtocolError(
            f"{where}: {field} is {len(raw)} bytes, but shape {shape} of {datatype} needs "
            f"{count * dtype.itemsize}"
        )
    values = np.frombuffer(raw, dtype=dtype)
    return values.copy() if copy else values


def from_contents(where: str, datatype: str, values: Any) -> np.ndarray:
    """A tensor's values as gRPC's typed field CONTENTS_FIELDS[datatype] holds them, flat:
    widened integers (INT8 in int_contents) must be within the datatype's range."""
    field, held = CONTENTS_FIELDS[datatype]
    if datatype == BYTES:
        return object_array([text_or_bytes(item) for item in values])
    wide = np.array(values, dtype=held)
    dtype = DATATYPES[datatype]
    if wide.size and dtype.kind in "iu" and dtype != held:
        info = np.iinfo(dtype)
        if wide.min() < info.min or wide.max() > info.max:
            raise ProtocolError(
                f"{where}: contents.{field} holds a value out of {datatype}'s range"
            )
    return wide.astype(dtype, copy=False)


def _leaves(data: Any) -> Iterator[Any]:
    """The scalars of a (nested) JSON list in row-major order; iterative, as JSON may nest
    deeper than Python's stack."""
    stack = [iter([data])]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                stack.append(iter(item))
                break
            yield item
        else:
            stack.pop()


def _numbers_from_json(where: str, datatype: str, data: Any) -> np.ndarray:
    """JSON values of the right kind, as Triton requires: a float for an integer input (1.7)
    would be truncated silently, a number for BOOL read as truthiness, "1" for FP32 parsed."""
    dtype = DATATYPES[datatype]
    kinds, what = _JSON_KINDS[dtype.kind]
    wrong = next((v for v in _leaves(data) if type(v) not in kinds), _ALL_RIGHT)
    if wrong is not _ALL_RIGHT:
        raise ProtocolError(f"{where}: data holds {clip(wrong)}; {datatype} takes {what} only")
    try:
        return np.asarray(data, dtype=dtype).reshape(-1)
    except OverflowError as exc:  # 300 for UINT8, 2**70 for INT64
        raise ProtocolError(
            f"{where}: data holds a value out of {datatype}'s range ({exc})"
        ) from None
    except ValueError as exc:  # ragged nesting, or deeper than numpy's dims
        raise ProtocolError(
            f"{where}: data must be a flat or evenly nested list of {datatype} values ({exc})"
        ) from None


def _bytes_from_json(where: str, data: Any) -> np.ndarray:
    """JSON strings, flattened in row-major order, as an object array of str."""
    items = list(_leaves(data))
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise ProtocolError(f"{where}: element {i} is {clip(item)}; BYTES takes JSON strings")
        try:
            item.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate, legal in JSON's \u escapes
            raise ProtocolError(f"{where}: element {i} is not valid Unicode text") from None
    return object_array(items)


def bytes_from_binary(where: str, data: memoryview, count: int) -> np.ndarray:
    """Length-prefixed elements (4-byte little-endian length, then the bytes), each as text
    where it is UTF-8 (`text_or_bytes`)."""
    items: list[str] = []
    offset = 0
    # Stops past `count` elements: a lying shape cannot make it walk a huge body for nothing.
    while offset < len(data) and len(items) <= count:
        if len(data) - offset < 4:
            raise ProtocolError(f"{where}: element {len(items)} is cut short in its length")
        (length,) = struct.unpack_from("<I", data, offset)
        offset += 4
        if length > len(data) - offset:
            raise ProtocolError(
                f"{where}: element {len(items)} declares {length} bytes, but only "
                f"{len(data) - offset} of its binary_data_size remain"
            )
        items.append(text_or_bytes(data[offset : offset + length]))
        offset += length
    return object_array(items)


def text_or_bytes(item: bytes | memoryview) -> str | bytes:
    """A BYTES element as text where it is UTF-8 (what ONNX string inputs take), else as the
    bytes it is (an encoded image for a pipeline): a model that takes text refuses those."""
    try:
        return str(item, "utf-8")
    except UnicodeDecodeError:
        return bytes(item)


def not_text(array: np.ndarray, what: str) -> str | None:
    """Why `array` (a BYTES tensor as decoded here) cannot feed an ONNX string input: the
    first element that is not UTF-8 text; None if all are."""
    for index, item in enumerate(array.flat):
        if isinstance(item, bytes):
            try:
                item.decode("utf-8")
            except UnicodeDecodeError as exc:
                why = f"element {index} is not UTF-8 text ({exc.reason})"
                return f"{what}: {why}; ONNX strings are UTF-8"
    return None


def object_array(items: list[Any]) -> np.ndarray:
    array = np.empty(len(items), dtype=object)  # not np.array: it would nest lists, strip NULs
    array[:] = items
    return array


# ---------------------------------------------------------------- encoding


def raw_bytes(array: np.ndarray) -> tuple[str, bytes]:
    """A contiguous array's datatype and its raw layout: row-major elements, or BYTES elements
    each as its 4-byte little-endian length and its UTF-8 bytes."""
    datatype = datatype_of(array)
    if datatype != BYTES:
        return datatype, array.tobytes()
    parts = []
    for item in array.ravel():
        raw = item.encode("utf-8", "surrogatepass") if isinstance(item, str) else bytes(item)
        parts += [struct.pack("<I", len(raw)), raw]
    return datatype, b"".join(parts)


def encode_tensor(
    name: str, array: np.ndarray, binary: bool
) -> tuple[dict[str, Any], bytes | None]:
    """A JSON tensor, and its raw bytes to follow the header when `binary` (else None: the
    values are in its `data`). A 0-d array goes as shape [1], as np.ascontiguousarray has it."""
    array = np.ascontiguousarray(array)
    if binary:
        datatype, raw = raw_bytes(array)
        spec = {"name": name, "datatype": datatype, "shape": list(array.shape),
                "parameters": {"binary_data_size": len(raw)}}  # fmt: skip
        return spec, raw
    datatype = datatype_of(array)
    spec = {"name": name, "datatype": datatype, "shape": list(array.shape)}
    flat = array.ravel()
    spec["data"] = [_text(x) for x in flat] if datatype == BYTES else flat.tolist()
    return spec, None


def _text(item: Any) -> str:
    return item if isinstance(item, str) else bytes(item).decode("utf-8", "replace")


def join(header: bytes, blobs: list[bytes]) -> tuple[bytes, int | None]:
    """A message body: the JSON header, then the binary tensors; and the header's length
    (HEADER_LENGTH) when any follow it, else None (plain JSON)."""
    if not blobs:
        return header, None
    return b"".join([header, *blobs]), len(header)
