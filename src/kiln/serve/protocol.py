"""KServe v2 / Open Inference Protocol over HTTP: JSON tensors and the binary tensor extension.

The binary extension is what Triton's clients (`tritonclient[http]`) speak: the body is a JSON
header of `Inference-Header-Content-Length` bytes followed by the raw tensors, in the order of
the header's inputs (or outputs) whose `parameters.binary_data_size` is set. Outputs come back
binary when the request asks (`parameters.binary_data_output`, or per output
`parameters.binary_data`); otherwise as JSON `data`, flattened in row-major order.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# KServe datatype ↔ numpy. BYTES and BF16 are left out: no Kiln model takes strings, and numpy
# has no bfloat16, so both are refused with a message rather than half-supported.
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
_BY_NUMPY = {dtype: name for name, dtype in DATATYPES.items()}


class ProtocolError(Exception):
    """A request the protocol cannot accept; the message is sent back with HTTP 400."""


def datatype_of(array: np.ndarray) -> str:
    """The KServe datatype of a numpy array."""
    try:
        return _BY_NUMPY[array.dtype]
    except KeyError:
        raise ProtocolError(f"tensors of numpy dtype {array.dtype} cannot be sent") from None


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
        raise ProtocolError(f"unsupported Content-Encoding '{encoding}'; use gzip or deflate")
    inflater = zlib.decompressobj(wbits)
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise ProtocolError(f"the body is not valid {encoding} data ({exc})") from None
    if len(out) > limit:
        raise RequestTooLarge(limit)
    return out


def parse_request(body: bytes, header_length: int | None) -> InferRequest:
    """Decode an inference request body (JSON, or JSON header + binary tensors)."""
    if header_length is None:
        header_length = len(body)
    if not 0 < header_length <= len(body):
        raise ProtocolError(
            f"Inference-Header-Content-Length is {header_length}, but the body has "
            f"{len(body)} bytes"
        )
    try:
        header = json.loads(body[:header_length])
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"malformed JSON in the request: {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("inputs"), list):
        raise ProtocolError("the request must be a JSON object with an 'inputs' list")
    blob, offset = memoryview(body)[header_length:], 0
    inputs: dict[str, np.ndarray] = {}
    for spec in header["inputs"]:
        array, size = _decode_input(spec, blob[offset:])
        offset += size
        if spec["name"] in inputs:
            raise ProtocolError(f"input '{spec['name']}' is given twice")
        inputs[spec["name"]] = array
    if offset != len(blob):
        raise ProtocolError(
            f"the body has {len(blob) - offset} bytes of binary data no input claims"
        )
    params = _parameters(header, "request")
    outputs: dict[str, bool] = {}
    for spec in header.get("outputs") or []:
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise ProtocolError("each requested output must be an object with a 'name'")
        out_params = _parameters(spec, f"output '{spec['name']}'")
        if out_params.get("classification"):
            raise ProtocolError("the classification extension is not supported")
        binary = out_params.get("binary_data", params.get("binary_data_output", False))
        outputs[spec["name"]] = bool(binary)
    request_id = header.get("id")
    return InferRequest(
        id=str(request_id) if request_id is not None else None,
        inputs=inputs,
        outputs=outputs,
        binary_default=bool(params.get("binary_data_output", False)),
    )


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
    datatype, shape = spec.get("datatype"), spec.get("shape")
    if datatype not in DATATYPES:
        known = ", ".join(DATATYPES)
        raise ProtocolError(f"input '{name}': unsupported datatype {datatype!r}; use {known}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ProtocolError(f"input '{name}': 'shape' must be a list of non-negative integers")
    dtype, count = DATATYPES[datatype], int(np.prod(shape, dtype=np.int64))
    size = _parameters(spec, f"input '{name}'").get("binary_data_size")
    if size is not None:
        if not isinstance(size, int) or size != count * dtype.itemsize or size > len(blob):
            raise ProtocolError(
                f"input '{name}': binary_data_size is {size} bytes, but shape {shape} of "
                f"{datatype} needs {count * dtype.itemsize} (and {len(blob)} remain in the body)"
            )
        # A copy: the body buffer is released when the request ends, the array lives on.
        return np.frombuffer(blob[:size], dtype=dtype).reshape(shape).copy(), size
    if "data" not in spec:
        raise ProtocolError(f"input '{name}' has neither 'data' nor binary_data_size")
    try:
        _check_json_kind(name, datatype, dtype, spec["data"])
        array = np.asarray(spec["data"], dtype=dtype)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"input '{name}': data is not {datatype} ({exc})") from None
    if array.size != count:
        raise ProtocolError(
            f"input '{name}': shape {shape} needs {count} values, the data has {array.size}"
        )
    return array.reshape(shape), 0


def _check_json_kind(name: str, datatype: str, dtype: np.dtype, data: Any) -> None:
    """JSON numbers of the right kind, as Triton requires: a float for an integer input (1.7)
    would be truncated silently, a number for BOOL read as truthiness."""
    values = np.asarray(data)
    if values.size == 0:
        return
    kind = values.dtype.kind
    if dtype.kind in "iu" and kind not in "iu":
        first = values.reshape(-1)[0] if kind != "f" else values[values != np.floor(values)]
        example = (first.reshape(-1)[0] if np.size(first) else values.reshape(-1)[0]).item()
        raise ProtocolError(
            f"input '{name}': data holds {example!r}; {datatype} takes JSON integers only"
        )
    if dtype.kind == "b" and kind != "b":
        raise ProtocolError(f"input '{name}': data holds non-boolean values; BOOL takes true/false")


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
        tensor: dict[str, Any] = {
            "name": name,
            "datatype": datatype_of(array),
            "shape": list(array.shape),
        }
        if binary:
            blobs.append(array.tobytes())
            tensor["parameters"] = {"binary_data_size": len(blobs[-1])}
        else:
            tensor["data"] = array.ravel().tolist()
        tensors.append(tensor)
    header["outputs"] = tensors
    text = json.dumps(header).encode()
    if not blobs:
        return text, None
    return b"".join([text, *blobs]), len(text)
