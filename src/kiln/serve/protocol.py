"""KServe v2 / Open Inference Protocol over HTTP: JSON tensors and the binary tensor extension.

The binary extension is what Triton's clients (`tritonclient[http]`) speak: the body is a JSON
header of `Inference-Header-Content-Length` bytes followed by the raw tensors, in the order of
the header's inputs (or outputs) whose `parameters.binary_data_size` is set. Outputs come back
binary when the request asks (`parameters.binary_data_output`, or per output
`parameters.binary_data`); otherwise as JSON `data`, flattened in row-major order.

BYTES tensors (ONNX strings) are JSON strings in `data`; in binary, each element is a 4-byte
little-endian length and its bytes, as tritonclient's `serialize_byte_tensor` writes them. The
engines take ONNX strings as Python str, so elements must be UTF-8 text.

`model_config` is the model_configuration extension: a model described as Triton's ModelConfig
JSON, field names and types as its `model_config.proto` has them.

The gRPC service (grpc_service.py) reuses the shape and BYTES helpers: its raw tensors are laid
out as the binary extension's.

Everything here is parsed as untrusted input: a request the protocol cannot take raises
`ProtocolError` (HTTP 400) naming what is wrong, whatever the bytes, never another exception.
"""

from __future__ import annotations

import json
import math
import reprlib
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
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
_BY_NUMPY = {dtype: name for name, dtype in DATATYPES.items()}
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
    """A request the protocol cannot accept; the message is sent back with HTTP 400."""


def datatype_of(array: np.ndarray) -> str:
    """The KServe datatype of a numpy array (text and object arrays are BYTES)."""
    if array.dtype.kind in "OUS":
        return BYTES
    try:
        return _BY_NUMPY[array.dtype]
    except KeyError:
        raise ProtocolError(f"tensors of numpy dtype {array.dtype} cannot be sent") from None


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


@dataclass
class InferRequest:
    """A decoded inference request."""

    id: str | None
    inputs: dict[str, np.ndarray]
    # Requested outputs → sent binary? Empty means every output, binary per `binary_default`.
    outputs: dict[str, bool] = field(default_factory=dict)
    binary_default: bool = False


class RequestTooLarge(Exception):
    """The request body (after decompression) is over the server's limit; HTTP 413."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"request body exceeds the server's limit of {limit / 2**20:g} MiB "
            "(kiln serve --max-request-mb); send fewer or smaller tensors per request"
        )


def decompress(body: bytes, encoding: str | None, limit: int) -> bytes:
    """Undo `Content-Encoding: gzip|deflate` (tritonclient's request compression), refusing to
    inflate past `limit` bytes so a small compressed body cannot blow up memory."""
    if not encoding or encoding == "identity":
        return body
    wbits = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}.get(encoding)
    if wbits is None:
        raise ProtocolError(f"unsupported Content-Encoding {clip(encoding)}; use gzip or deflate")
    inflater = zlib.decompressobj(wbits)
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise ProtocolError(f"the body is not valid {encoding} data ({exc})") from None
    if len(out) > limit:
        raise RequestTooLarge(limit)
    return out


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


def parse_request(body: bytes, header_length: int | None) -> InferRequest:
    """Decode an inference request body (JSON, or JSON header + binary tensors)."""
    if not body:
        raise ProtocolError("the request body is empty; send a JSON object with an 'inputs' list")
    if header_length is None:
        header_length = len(body)
    if not 0 < header_length <= len(body):
        raise ProtocolError(
            f"Inference-Header-Content-Length is {header_length}, but the body has "
            f"{len(body)} bytes"
        )
    header = _load_json(body[:header_length])
    if not isinstance(header, dict) or not isinstance(header.get("inputs"), list):
        raise ProtocolError("the request must be a JSON object with an 'inputs' list")
    blob, offset = memoryview(body)[header_length:], 0
    inputs: dict[str, np.ndarray] = {}
    for spec in header["inputs"]:
        array, size = _decode_input(spec, blob[offset:])
        offset += size
        if spec["name"] in inputs:
            raise ProtocolError(f"input {clip(spec['name'])} is given twice")
        inputs[spec["name"]] = array
    if offset != len(blob):
        raise ProtocolError(
            f"the body has {len(blob) - offset} bytes of binary data no input claims"
        )
    params = _parameters(header, "request")
    requested = header.get("outputs")
    if requested is not None and not isinstance(requested, list):
        raise ProtocolError("'outputs' must be a list of {\"name\": ...} objects")
    outputs: dict[str, bool] = {}
    for spec in requested or []:
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise ProtocolError("each requested output must be an object with a 'name'")
        out_params = _parameters(spec, f"output {clip(spec['name'])}")
        if out_params.get("classification"):
            raise ProtocolError("the classification extension is not supported")
        binary = out_params.get("binary_data", params.get("binary_data_output", False))
        outputs[spec["name"]] = bool(binary)
    request_id = header.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise ProtocolError(f"the request 'id' must be a string, got {clip(request_id)}")
    return InferRequest(
        id=request_id,
        inputs=inputs,
        outputs=outputs,
        binary_default=bool(params.get("binary_data_output", False)),
    )


def _load_json(raw: bytes | memoryview) -> Any:
    try:
        return json.loads(bytes(raw))
    except RecursionError:
        raise ProtocolError("the request's JSON is nested too deeply") from None
    except ValueError as exc:  # bad JSON, bad UTF-8, or an integer of thousands of digits
        raise ProtocolError(f"malformed JSON in the request: {exc}") from None


def _parameters(obj: dict[str, Any], where: str) -> dict[str, Any]:
    params = obj.get("parameters") or {}
    if not isinstance(params, dict):
        raise ProtocolError(f"'parameters' of the {where} must be a JSON object")
    return params


def _decode_input(spec: Any, blob: memoryview) -> tuple[np.ndarray, int]:
    """One input tensor, and how many bytes of binary data it used."""
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ProtocolError("each input must be a JSON object with a 'name'")
    name = spec["name"]
    where = f"input {clip(name)}"
    datatype = spec.get("datatype")
    if datatype != BYTES and (not isinstance(datatype, str) or datatype not in DATATYPES):
        known = ", ".join([*DATATYPES, BYTES])
        raise ProtocolError(f"{where}: unsupported datatype {clip(datatype)}; use {known}")
    shape = check_shape(where, spec.get("shape"))
    count = math.prod(shape)  # a Python int: a lying shape cannot overflow it
    size = _parameters(spec, where).get("binary_data_size")
    if size is not None:
        if type(size) is not int or not 0 <= size <= len(blob):
            raise ProtocolError(
                f"{where}: binary_data_size must be a byte count within the {len(blob)} bytes "
                f"of binary data left in the body, got {clip(size)}"
            )
        if datatype == BYTES:
            values = bytes_from_binary(where, blob[:size], count)
        else:
            dtype = DATATYPES[datatype]
            if size != count * dtype.itemsize:
                raise ProtocolError(
                    f"{where}: binary_data_size is {size} bytes, but shape {shape} of "
                    f"{datatype} needs {count * dtype.itemsize}"
                )
            # A copy: the body buffer is released when the request ends, the array lives on.
            values = np.frombuffer(blob[:size], dtype=dtype).copy()
    elif "data" in spec:
        if datatype == BYTES:
            values = _bytes_from_json(where, spec["data"])
        else:
            values = _numbers_from_json(where, datatype, spec["data"])
        size = 0
    else:
        raise ProtocolError(f"{where} has neither 'data' nor binary_data_size")
    if values.size != count:
        raise ProtocolError(
            f"{where}: shape {shape} needs {count} values, the data has {values.size}"
        )
    try:
        return values.reshape(shape), size
    except ValueError as exc:  # an empty tensor whose other dims overflow numpy's sizes
        raise ProtocolError(f"{where}: shape {shape} cannot be a tensor ({exc})") from None


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
    """Length-prefixed elements (4-byte little-endian length, then the bytes), UTF-8 decoded."""
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
        try:
            items.append(str(data[offset : offset + length], "utf-8"))
        except UnicodeDecodeError as exc:
            raise ProtocolError(
                f"{where}: element {len(items)} is not UTF-8 text ({exc.reason}); ONNX strings "
                "are UTF-8"
            ) from None
        offset += length
    return object_array(items)


def object_array(items: list[Any]) -> np.ndarray:
    array = np.empty(len(items), dtype=object)  # not np.array: it would nest lists, strip NULs
    array[:] = items
    return array


def encode_response(
    model_name: str,
    request: InferRequest,
    outputs: dict[str, np.ndarray],
    model_version: str | None = None,
) -> tuple[bytes, int | None]:
    """The response body, and the JSON header's length when binary tensors follow it."""
    wanted = request.outputs or dict.fromkeys(outputs, request.binary_default)
    header: dict[str, Any] = {"model_name": model_name}
    if model_version:
        header["model_version"] = model_version
    if request.id is not None:
        header["id"] = request.id
    tensors, blobs = [], []
    for name, binary in wanted.items():
        array = np.ascontiguousarray(outputs[name])
        datatype = datatype_of(array)
        tensor: dict[str, Any] = {"name": name, "datatype": datatype, "shape": list(array.shape)}
        if binary:
            blobs.append(binary_bytes(array) if datatype == BYTES else array.tobytes())
            tensor["parameters"] = {"binary_data_size": len(blobs[-1])}
        elif datatype == BYTES:
            tensor["data"] = [_text(x) for x in array.ravel()]
        else:
            tensor["data"] = array.ravel().tolist()
        tensors.append(tensor)
    header["outputs"] = tensors
    text = json.dumps(header).encode()
    if not blobs:
        return text, None
    return b"".join([text, *blobs]), len(text)


def _text(item: Any) -> str:
    return item if isinstance(item, str) else bytes(item).decode("utf-8", "replace")


def binary_bytes(array: np.ndarray) -> bytes:
    """BYTES elements, each as its 4-byte little-endian length and its UTF-8 bytes."""
    parts = []
    for item in array.ravel():
        raw = item.encode("utf-8", "surrogatepass") if isinstance(item, str) else bytes(item)
        parts += [struct.pack("<I", len(raw)), raw]
    return b"".join(parts)


# ---------------------------------------------------------------- model_configuration


def triton_type(datatype: str) -> str:
    """Triton's ModelConfig data type for a KServe datatype: FP32 → TYPE_FP32, BYTES →
    TYPE_STRING (the one whose name differs)."""
    return "TYPE_STRING" if datatype == BYTES else f"TYPE_{datatype}"


def model_config(
    name: str,
    inputs: list[dict[str, Any]],
    outputs: list[dict[str, Any]],
    *,
    platform: str,
    backend: str,
    kind: str,
    max_batch_size: int,
    max_delay_s: float,
) -> dict[str, Any]:
    """Triton's ModelConfig for a model whose `inputs` and `outputs` are KServe metadata
    ({name, datatype, shape}, -1 for a dynamic dim). With `max_batch_size` > 0 every shape
    leads with the batch dim, which Triton leaves out of `dims`, and requests are batched
    within `max_delay_s` (0: from what is already waiting)."""
    batched = max_batch_size > 0
    config: dict[str, Any] = {
        "name": name,
        "platform": platform,
        "backend": backend,
        "max_batch_size": max_batch_size,
        "input": [_tensor_config(spec, batched) for spec in inputs],
        "output": [_tensor_config(spec, batched) for spec in outputs],
        "instance_group": [{"kind": kind, "count": 1}],  # one session, one batcher
    }
    if batched:  # Triton refuses dynamic batching without a batch dim
        config["dynamic_batching"] = {"max_queue_delay_microseconds": round(max_delay_s * 1e6)}
    return config


def _tensor_config(spec: dict[str, Any], batched: bool) -> dict[str, Any]:
    dims = list(spec["shape"][1:] if batched else spec["shape"])
    tensor: dict[str, Any] = {
        "name": spec["name"],
        "data_type": triton_type(spec["datatype"]),
        "dims": dims or [1],
    }
    if not dims:  # one value per batch row: Triton writes it as [1], reshaped to none
        tensor["reshape"] = {"shape": []}
    return tensor
