"""KServe v2 / Open Inference Protocol over HTTP: an inference request's body decoded, its
answer encoded, and the model_configuration extension. The tensors themselves, JSON and the
binary tensor extension, are kiln.wire's.

Outputs come back binary when the request asks (`parameters.binary_data_output`, or per output
`parameters.binary_data`); otherwise as JSON `data`, flattened in row-major order.

`model_config` is the model_configuration extension: a model described as Triton's ModelConfig
JSON, field names and types as its `model_config.proto` has them.

Everything here is parsed as untrusted input: a request the protocol cannot take raises
`ProtocolError` (HTTP 400) naming what is wrong, whatever the bytes, never another exception.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kiln.wire import BYTES, ProtocolError, clip, decode_tensor, encode_tensor, join, parameters_of


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


def parse_request(
    body: bytes, header_length: int | None, names: Collection[str] | None = None
) -> InferRequest:
    """Decode an inference request body (JSON, or JSON header + binary tensors); an input not
    among `names` (the model's inputs) is refused before its data is read."""
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
        array, size = decode_tensor(spec, blob[offset:], names=names)
        offset += size
        if spec["name"] in inputs:
            raise ProtocolError(f"input {clip(spec['name'])} is given twice")
        inputs[spec["name"]] = array
    if offset != len(blob):
        raise ProtocolError(
            f"the body has {len(blob) - offset} bytes of binary data no input claims"
        )
    params = parameters_of(header, "request")
    requested = header.get("outputs")
    if requested is not None and not isinstance(requested, list):
        raise ProtocolError("'outputs' must be a list of {\"name\": ...} objects")
    outputs: dict[str, bool] = {}
    for spec in requested or []:
        if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
            raise ProtocolError("each requested output must be an object with a 'name'")
        out_params = parameters_of(spec, f"output {clip(spec['name'])}")
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
        tensor, raw = encode_tensor(name, outputs[name], binary)
        tensors.append(tensor)
        if raw is not None:
            blobs.append(raw)
    header["outputs"] = tensors
    return join(json.dumps(header).encode(), blobs)


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
