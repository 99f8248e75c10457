"""KServe v2 over gRPC: Triton's `inference.GRPCInferenceService`, served beside HTTP on the
same `ModelSet` — the same models, batchers, limits, metrics and statistics.

Served: ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata, ModelConfig,
ModelStatistics, RepositoryIndex, RepositoryModelLoad, RepositoryModelUnload and ModelInfer.
Every other method of the service (streaming, shared memory, trace and log settings) answers
UNIMPLEMENTED, in Kiln's words: what is not served and what to do instead.

ModelInfer takes each input's tensor either in `raw_input_contents` (one entry per input, in
order, laid out as HTTP's binary extension: BYTES elements length-prefixed) or in its typed
`contents` field; outputs always come back in `raw_output_contents`, as Triton sends them. Past
the wire format a request takes HTTP's own path (`service.infer`): the same checks, batcher,
limits, metrics and statistics.

Errors carry Triton's codes for the failure HTTP answers with a status: 400 INVALID_ARGUMENT,
404 NOT_FOUND, 503 UNAVAILABLE (queue full, model loading, server stopping), 500 INTERNAL;
a message over --max-request-mb is RESOURCE_EXHAUSTED, said and counted for the model it names
as HTTP's 413 (up to OVERSIZE_READ times the limit, which is read to be refused; past that gRPC
refuses it unread, in its own words, and uncounted).

The server is gRPC's asyncio server on a thread and event loop of its own: neither protocol's
loop waits on the other's, and a request awaits its batch as an HTTP request does, so the
queue bound (not a thread count) is what limits requests in flight.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import socket
import threading
from collections.abc import Awaitable, Callable, Collection, Coroutine
from typing import Any, TypeVar

import grpc
import numpy as np
from google.protobuf import json_format
from google.protobuf.message import Message

from kiln.errors import KilnError
from kiln.serve._proto import SERVICE_NAME, message, service
from kiln.serve.models import ModelSet, ModelUnavailable, ServedModel
from kiln.serve.protocol import InferRequest, RequestTooLarge
from kiln.serve.server import bind, resolve
from kiln.serve.service import (
    INLINE_BYTES,
    Refused,
    check_load_parameters,
    check_unload_parameters,
    infer,
    repository_change,
    server_metadata,
    small_answer,
    status_of,
)
from kiln.wire import (
    BYTES,
    CONTENTS_FIELDS,
    ProtocolError,
    check_datatype,
    check_name,
    check_shape,
    clip,
    from_contents,
    from_raw,
    raw_bytes,
    shaped,
)

log = logging.getLogger("uvicorn.error")  # configured by uvicorn, so it reaches the console
# How long a stopping server waits for requests in flight (they are queued in a batcher, so
# seconds at most); HTTP's uvicorn waits for its own as long as they take.
STOP_GRACE_S = 60.0

# The HTTP status kiln serve answers → the gRPC code Triton gives the same failure
# (triton-inference-server/server src/grpc/grpc_utils.cc, GrpcStatusUtil::CodeToStatus).
CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    404: grpc.StatusCode.NOT_FOUND,
    408: grpc.StatusCode.DEADLINE_EXCEEDED,
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    499: grpc.StatusCode.CANCELLED,
    500: grpc.StatusCode.INTERNAL,
    501: grpc.StatusCode.UNIMPLEMENTED,
    503: grpc.StatusCode.UNAVAILABLE,
}

_SHARED_MEMORY = "shared_memory_region"
# How far past --max-request-mb a message is still read, to be refused in Kiln's words: gRPC
# itself refuses larger ones unread (its own text), which keeps memory bounded.
OVERSIZE_READ = 2

_SHARED_MEMORY_TEXT = (
    "the shared-memory extension is not supported by kiln serve; send each tensor in the "
    "request (raw_input_contents or contents)"
)
# Kiln's answer to each method of the service it does not serve (gRPC's: "Method not found!").
NOT_SERVED = {
    "ModelStreamInfer": "streaming inference (ModelStreamInfer) is not served by kiln serve; "
    "send each request with ModelInfer (tritonclient: infer or async_infer)",
    "TraceSetting": "trace settings are not served by kiln serve; its request counts and "
    "timings are in ModelStatistics and at /metrics on the HTTP port",
    "LogSettings": "log settings are not served by kiln serve; its log goes to its stderr",
    **{
        f"{kind}SharedMemory{call}": _SHARED_MEMORY_TEXT
        for kind in ("System", "Cuda")
        for call in ("Status", "Register", "Unregister")
    },
}

ModelInferResponse = message("ModelInferResponse")


# ---------------------------------------------------------------- tensors in and out


def decode_request(request: Message, names: Collection[str] | None = None) -> InferRequest:
    """A ModelInferRequest's tensors, checked as HTTP checks its own: ProtocolError naming
    the input and what is wrong; an input not among `names` (the model's inputs) first."""
    raw = request.raw_input_contents
    if raw and len(raw) != len(request.inputs):
        raise ProtocolError(
            f"raw_input_contents holds {len(raw)} tensors for {len(request.inputs)} inputs; "
            "send one per input, in the inputs' order, or none and each input's contents"
        )
    inputs: dict[str, np.ndarray] = {}
    for i, tensor in enumerate(request.inputs):
        if tensor.name in inputs:
            raise ProtocolError(f"input {clip(tensor.name)} is given twice")
        check_name(tensor.name, names)
        inputs[tensor.name] = _input(tensor, raw[i] if raw else None)
    outputs: dict[str, bool] = {}
    for wanted in request.outputs:
        where = f"output {clip(wanted.name)}"
        if "classification" in wanted.parameters:
            raise ProtocolError(f"{where}: the classification extension is not supported")
        _no_shared_memory(wanted.parameters, where)
        outputs[wanted.name] = True  # over gRPC every output is raw
    request_id = request.id or None  # proto3's "": no id given
    return InferRequest(id=request_id, inputs=inputs, outputs=outputs, binary_default=True)


def _input(tensor: Message, raw: bytes | None) -> np.ndarray:
    where = f"input {clip(tensor.name)}"
    _no_shared_memory(tensor.parameters, where)
    datatype = check_datatype(where, tensor.datatype)
    shape = check_shape(where, list(tensor.shape))
    if raw is None:
        values = _from_contents(where, datatype, tensor.contents)
    elif tensor.HasField("contents") and tensor.contents.ListFields():
        raise ProtocolError(
            f"{where} has both contents and raw_input_contents; send the tensor in one"
        )
    else:  # a view of the message's bytes, not a copy
        values = from_raw(where, datatype, shape, raw, "raw_input_contents", copy=False)
    return shaped(where, values, shape)


def _no_shared_memory(parameters: Any, where: str) -> None:
    if _SHARED_MEMORY in parameters:
        raise ProtocolError(
            f"{where}: the shared-memory extension is not supported; send the tensor in the request"
        )


def _from_contents(where: str, datatype: str, contents: Message) -> np.ndarray:
    """A tensor in its typed field, which must be the one its datatype takes (as Triton
    requires): INT8 in int_contents, within INT8's range."""
    field, _ = CONTENTS_FIELDS.get(datatype, (None, None))
    if field is None:
        raise ProtocolError(
            f"{where}: {datatype} has no typed contents field; send it in raw_input_contents"
        )
    others = [f.name for f, _ in contents.ListFields() if f.name != field]
    if others:
        raise ProtocolError(f"{where}: {datatype} data goes in contents.{field}, not {others[0]}")
    values = getattr(contents, field)
    if not values:
        raise ProtocolError(
            f"{where} has no data: send it in raw_input_contents or in contents.{field}"
        )
    return from_contents(where, datatype, list(values))


def encode_response(
    served: ServedModel, request: InferRequest, outputs: dict[str, np.ndarray]
) -> Message:
    """A ModelInferResponse: the requested outputs (else all), in raw_output_contents."""
    response = ModelInferResponse(
        model_name=served.name, model_version=served.version, id=request.id or ""
    )
    for name in request.outputs or outputs:
        array = np.ascontiguousarray(outputs[name])
        datatype, raw = raw_bytes(array)
        response.outputs.add(name=name, datatype=datatype, shape=array.shape)
        response.raw_output_contents.append(raw)
    return response


# ---------------------------------------------------------------- the service

Handler = Callable[[Any, Message, grpc.aio.ServicerContext], Awaitable[Message]]
_Method = TypeVar("_Method", bound=Handler)


def _answers(method: _Method) -> _Method:
    """A method whose failures are answered with Triton's code and Kiln's message."""

    @functools.wraps(method)
    async def call(self: Any, request: Message, context: grpc.aio.ServicerContext) -> Message:
        try:
            return await method(self, request, context)
        except Exception as exc:
            status, text = status_of(exc)
            # Not the client's fault: keep the traceback for the operator (a Refused one was
            # kept where it happened).
            if status == 500 and not isinstance(exc, Refused):
                log.exception("gRPC %s failed", method.__name__)
        await context.abort(CODES.get(status, grpc.StatusCode.UNKNOWN), text)
        raise AssertionError("abort returns only by raising")  # for type checkers

    return call  # type: ignore[return-value]


def _parse(values: dict[str, Any], name: str, *, strict: bool = True) -> Message:
    """Message `inference.NAME` from the JSON HTTP answers: one source for both protocols."""
    return json_format.ParseDict(values, message(name)(), ignore_unknown_fields=not strict)


def _version(version: str) -> str | None:
    return version or None  # proto3's "" is "not given": the version served


def _no_repository_name(request: Message) -> None:
    if request.repository_name:
        raise Refused(501, "'repository_name' specification is not supported")  # Triton's words


async def _repository_change(
    request: Message, check: Callable[[list[str]], None], change: Callable[[str], object]
) -> None:
    """A load or unload of `request.model_name`, its request checked as HTTP checks it. A load
    takes seconds: off the event loop, so other requests keep being answered."""
    _no_repository_name(request)
    check(list(request.parameters))
    await repository_change(change, request.model_name)


class InferenceServicer:
    """GRPCInferenceService over a `ModelSet`: each method answers what the matching HTTP
    endpoint answers, from the same functions. Methods are named as the service's RPCs, which
    is how `handlers` finds them. A ModelInfer message over `max_request_bytes` is refused
    unparsed (only the model it names is read, to count the refusal)."""

    def __init__(self, models: ModelSet, max_request_bytes: int = 64 << 20) -> None:
        self.models = models
        self.max_request_bytes = max_request_bytes

    @_answers
    async def ServerLive(self, request: Message, context: Any) -> Message:
        return message("ServerLiveResponse")(live=True)

    @_answers
    async def ServerReady(self, request: Message, context: Any) -> Message:
        return message("ServerReadyResponse")(ready=self.models.ready())

    @_answers
    async def ModelReady(self, request: Message, context: Any) -> Message:
        # Triton answers ready=false, not an error, for a model it does not serve.
        try:
            ready = self.models.get(request.name, _version(request.version)).accepting
        except ModelUnavailable:
            ready = False
        return message("ModelReadyResponse")(ready=ready)

    @_answers
    async def ServerMetadata(self, request: Message, context: Any) -> Message:
        return _parse(server_metadata(self.models), "ServerMetadataResponse")

    @_answers
    async def ModelMetadata(self, request: Message, context: Any) -> Message:
        metadata = self.models.get(request.name, _version(request.version)).metadata()
        # Kiln's extension (an input's max_shape) has no field in the message.
        return _parse(metadata, "ModelMetadataResponse", strict=False)

    @_answers
    async def ModelConfig(self, request: Message, context: Any) -> Message:
        config = self.models.get(request.name, _version(request.version)).config()
        return message("ModelConfigResponse")(config=_parse(config, "ModelConfig"))

    @_answers
    async def ModelStatistics(self, request: Message, context: Any) -> Message:
        if request.name:
            served = [self.models.get(request.name, _version(request.version))]
        else:  # Triton: no name, every model
            served = self.models.served()
        stats = [m.metrics.statistics.to_json() for m in served]
        return _parse({"model_stats": stats}, "ModelStatisticsResponse")

    @_answers
    async def RepositoryIndex(self, request: Message, context: Any) -> Message:
        _no_repository_name(request)
        rows = self.models.index(ready_only=request.ready)  # every server has one, as Triton
        return _parse({"models": rows}, "RepositoryIndexResponse")

    @_answers
    async def RepositoryModelLoad(self, request: Message, context: Any) -> Message:
        self.models.need_repository("load")  # before the parameters, as over HTTP
        await _repository_change(request, check_load_parameters, self.models.load)
        return message("RepositoryModelLoadResponse")()

    @_answers
    async def RepositoryModelUnload(self, request: Message, context: Any) -> Message:
        await _repository_change(request, check_unload_parameters, self.models.unload)
        return message("RepositoryModelUnloadResponse")()

    @_answers
    async def ModelInfer(self, request: Message, context: Any) -> Message:
        oversized = isinstance(request, Oversized)
        if oversized and request.model_name is None:  # no model to count it for
            raise RequestTooLarge(self.max_request_bytes)
        # Held to the answer: an unload or a newer version waits for this request to finish.
        with self.models.lease(request.model_name, _version(request.model_version)) as served:

            async def read() -> Message:
                if oversized:  # refused where HTTP refuses its 413: counted for the model
                    raise RequestTooLarge(self.max_request_bytes)
                return request  # gRPC has read and parsed the message already

            async def decode(received: Message) -> InferRequest:
                if _raw_and_small(received):
                    return decode_request(received, served.inputs)
                return await asyncio.to_thread(decode_request, received, served.inputs)

            async def encode(decoded: InferRequest, outputs: dict[str, np.ndarray]) -> Message:
                if small_answer(outputs, decoded.outputs or dict.fromkeys(outputs, True)):
                    return encode_response(served, decoded, outputs)
                return await asyncio.to_thread(encode_response, served, decoded, outputs)

            return await infer(served, read, decode, encode)


def _raw_and_small(request: Message) -> bool:
    """Whether decoding `request` is cheap enough for the event loop (service.INLINE_BYTES):
    every tensor raw (a view of the message's bytes) and none of them BYTES elements."""
    raw = request.raw_input_contents
    return (
        len(raw) == len(request.inputs)
        and sum(map(len, raw)) <= INLINE_BYTES
        and all(tensor.datatype != BYTES for tensor in request.inputs)
    )


class Oversized:
    """A ModelInfer message over the limit, read by gRPC but left unparsed: only the model it
    names is read (`model_name` None where it names none readably), so that its refusal is
    counted for that model, as HTTP counts a 413."""

    def __init__(self, data: bytes) -> None:
        self.model_name: str | None = None
        self.model_version = ""
        try:
            fields = _top_fields(data, wanted=(1, 2))  # ModelInferRequest's name and version
            self.model_name = fields[1].decode() if 1 in fields else None
            self.model_version = fields.get(2, b"").decode()
        except (IndexError, UnicodeDecodeError):  # malformed: refused unnamed, not counted
            self.model_name = None


def _top_fields(data: bytes, wanted: tuple[int, ...]) -> dict[int, bytes]:
    """The length-delimited top-level fields `wanted` of a protobuf message, by walking its
    wire format: every other field (each tensor's bytes) is skipped, not parsed nor copied.
    IndexError for bytes that are not a message."""

    def varint(at: int) -> tuple[int, int]:
        value, shift = 0, 0
        while True:
            byte = data[at]
            value, shift, at = value | (byte & 0x7F) << shift, shift + 7, at + 1
            if byte < 0x80:
                return value, at

    found: dict[int, bytes] = {}
    at = 0
    while at < len(data):
        key, at = varint(at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            at = varint(at)[1]
        elif wire in (1, 5):
            at += 8 if wire == 1 else 4
        elif wire == 2:
            size, at = varint(at)
            if number in wanted:
                found[number] = data[at : at + size]
            at += size
        else:  # groups (deprecated) and invalid types: not a ModelInferRequest
            raise IndexError(f"wire type {wire}")
    if at > len(data):
        raise IndexError("truncated field")
    return found


def _parser(name: str, limit: int | None) -> Callable[[bytes], Message | Oversized]:
    """Message `name` from its bytes; with a `limit`, an `Oversized` past it."""
    parse = message(name).FromString
    if limit is None:
        return parse
    return lambda data: Oversized(data) if len(data) > limit else parse(data)


def handlers(servicer: InferenceServicer) -> grpc.GenericRpcHandler:
    """Every method of the service: those `servicer` has, with their messages'
    (de)serializers; the others refused in Kiln's words (`NOT_SERVED`)."""
    methods = {}
    for method in service().methods:
        implementation = getattr(servicer, method.name, None)
        if implementation is None:
            methods[method.name] = _not_served(method.name, method.client_streaming)
            continue
        limit = servicer.max_request_bytes if method.name == "ModelInfer" else None
        methods[method.name] = grpc.unary_unary_rpc_method_handler(
            implementation,
            request_deserializer=_parser(method.input_type.name, limit),
            response_serializer=message(method.output_type.name).SerializeToString,
        )
    return grpc.method_handlers_generic_handler(SERVICE_NAME, methods)


def _not_served(name: str, streaming: bool) -> grpc.RpcMethodHandler:
    """A handler answering UNIMPLEMENTED with what Kiln says of method `name`; its request is
    not parsed."""
    text = NOT_SERVED.get(name, f"{name} is not served by kiln serve")

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, text)

    if streaming:
        return grpc.stream_stream_rpc_method_handler(refuse)
    return grpc.unary_unary_rpc_method_handler(refuse)


# ---------------------------------------------------------------- the server

_T = TypeVar("_T")


class GrpcServer:
    """gRPC's asyncio server on a thread of its own. Bound at construction (KilnError naming
    --grpc-port when it cannot be), answering once `start`ed, stopped by `stop`: new calls are
    refused, those in flight answered."""

    def __init__(self, host: str, port: int, *, max_request_bytes: int) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kiln-grpc")
        self._thread.daemon = True  # never holds the process up: stop() is the clean way out
        self._thread.start()
        self._server: grpc.aio.Server | None = None
        self._max_request_bytes = max_request_bytes
        try:
            self.port = self._call(self._bind(host, port, max_request_bytes))
        except BaseException:
            self._end_loop()
            raise

    def start(self, models: ModelSet) -> None:
        """Serve `models`."""
        self._call(self._start(models))

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """Refuse new calls, answer those in flight (for at most `grace_s`), end the thread.
        Safe to call twice."""
        if self._server is not None and self._loop.is_running():
            self._call(self._server.stop(grace_s))
        self._end_loop()

    def _call(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def _end_loop(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
        if not self._loop.is_closed():
            self._loop.close()

    async def _bind(self, host: str, port: int, max_request_bytes: int) -> int:
        family, _, _, address = resolve(host, port, "--grpc-port")
        if port:  # a port taken is said in Kiln's words (gRPC would log a line of its own too)
            bind(host, port, "--grpc-port").close()
        target = f"[{address[0]}]:{port}" if family == socket.AF_INET6 else f"{address[0]}:{port}"
        self._server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", OVERSIZE_READ * max_request_bytes),
                ("grpc.max_send_message_length", -1),  # answers are as large as the model's
                ("grpc.so_reuseport", 0),  # a port in use is an error, not silently shared
            ]
        )
        try:
            bound = self._server.add_insecure_port(target)
        except RuntimeError:
            bound = 0
        if not bound:  # taken since it was probed, or refused for a reason of gRPC's own
            raise KilnError(f"--grpc-port {port}: gRPC cannot listen on {target}.")
        return bound

    async def _start(self, models: ModelSet) -> None:
        assert self._server is not None
        servicer = InferenceServicer(models, self._max_request_bytes)
        self._server.add_generic_rpc_handlers((handlers(servicer),))
        await self._server.start()
