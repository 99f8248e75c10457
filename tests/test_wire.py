"""The KServe v2 wire format that the HTTP server, the gRPC service and the remote session
share: every datatype goes out and comes back the same, JSON or binary, and a remote
session reads what the server writes."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kiln.errors import KilnError
from kiln.runtime.remote import decode_response, encode_request
from kiln.serve.protocol import InferRequest, encode_response, parse_request
from kiln.wire import BYTES, DATATYPES, ProtocolError, decode_tensor, encode_tensor, object_array

ARRAYS = {
    **{name: np.arange(6).reshape(2, 3).astype(dtype) for name, dtype in DATATYPES.items()},
    BYTES: object_array(["a", "", "ünï", "x\x00y"]).reshape(2, 2),
}


@pytest.mark.parametrize("binary", [False, True])
@pytest.mark.parametrize("datatype", list(ARRAYS))
def test_a_tensor_comes_back_as_it_went(datatype: str, binary: bool) -> None:
    array = ARRAYS[datatype]
    spec, raw = encode_tensor("t", array, binary)
    assert spec["datatype"] == datatype and (raw is not None) == binary
    back, used = decode_tensor(json.loads(json.dumps(spec)), memoryview(raw or b""), "output")
    assert used == len(raw or b"") and back.shape == array.shape
    assert back.tolist() == array.tolist()


def test_a_remote_session_reads_what_the_server_writes() -> None:
    outputs = {"logits": ARRAYS["FP32"], "label": ARRAYS[BYTES], "scalar": np.float32(2.5)}
    for binary in (False, True):
        request = InferRequest(id=None, inputs={}, binary_default=binary)
        body, length = encode_response("m", request, outputs)
        got = decode_response(body, None if length is None else str(length), "server")
        assert {name: got[name].tolist() for name in got} == {
            "logits": outputs["logits"].tolist(), "label": outputs["label"].tolist(),
            "scalar": [2.5],  # a 0-d output travels as shape [1]
        }  # fmt: skip
    with pytest.raises(KilnError, match="malformed inference response"):
        decode_response(body[:-1], str(length), "server")


def test_the_server_reads_what_a_remote_session_sends() -> None:
    body, length = encode_request([("x", ARRAYS["INT64"]), ("s", ARRAYS[BYTES])])
    request = parse_request(body, length)
    assert request.binary_default and request.inputs["x"].tolist() == ARRAYS["INT64"].tolist()
    assert request.inputs["s"].tolist() == ARRAYS[BYTES].tolist()
    with pytest.raises(ProtocolError, match="input .s.: binary_data_size must be a byte count"):
        parse_request(body[:-1], length)
