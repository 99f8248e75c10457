"""The HTTP application: KServe v2 endpoints over the models of a `ModelSet` (each a
`kiln.Session` with its own batcher), and the extensions Triton's clients call:
model_configuration (`/config`, Triton's ModelConfig), statistics (`/stats`, Triton's
statistics, the same counts /metrics exports) and, serving a repository, model_repository
(`v2/repository/index`, `.../load`, `.../unload`). /metrics holds Kiln's families and Triton's
`nv_inference_*` counters (every name: metrics.py, docs/reference/metrics.md).

Every error is answered in KServe's form, `{"error": "..."}`: 400 for a request the protocol or
the model cannot take (the message names the input and what was expected: a batch over the
max_batch_size /config advertises, a token id outside the vocabulary) or a load that failed,
404 for a model not served (unknown, or unloaded: Triton's NOT_FOUND), 408 for a body that
stops arriving (the connection is then closed), 413 for a body over the size limit, 503 (with
Retry-After) when the queue is full, the model is on its first load or the server is shutting
down, 500 only for a failure inside Kiln itself, never for anything a client sends.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Callable, Collection
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from kiln import __version__
from kiln.backends.release import trim_heap
from kiln.errors import KilnError
from kiln.serve.models import BatchSettings, ModelSet, ModelUnavailable, ServedModel
from kiln.serve.protocol import (
    InferRequest,
    RequestTooLarge,
    decompress,
    encode_response,
    parse_request,
)
from kiln.serve.service import (
    CLIENT_CLOSED,
    INLINE_BYTES,
    Refused,
    check_load_parameters,
    check_unload_parameters,
    infer,
    repository_change,
    server_metadata,
    small_answer,
)
from kiln.wire import ProtocolError, clip, header_length

log = logging.getLogger("uvicorn.error")  # configured by uvicorn, so it reaches the console
BODY_TIMEOUT = 408  # the one refusal after which the connection is closed: its body is unread
# Every 503 says when to try again (RFC 9110): a full queue drains, a load finishes, in about
# this many seconds; a client that honours it does not hammer a busy server.
RETRY_AFTER_S = 1
# A refused request of this size or more is followed by a heap trim: glibc keeps what its
# decoding freed (tens of MB for a 10 MB JSON body) in the decoding thread's arena, one per
# worker thread, so the resident size would climb per thread and never come down. Below it a
# walk over the heap is not worth it.
TRIM_ABOVE_BYTES = 1 << 20


class BodyTimeout(Refused):
    """The request body stopped arriving; HTTP 408 and the connection is closed."""

    def __init__(self, seconds: float) -> None:
        super().__init__(
            BODY_TIMEOUT,
            f"the request body did not arrive within {seconds:g} s of the headers (its "
            "Content-Length promised more bytes than were sent); the connection is closed",
        )


def create_app(
    session: Any,
    name: str,
    *,
    max_batch: int = 16,
    max_delay_ms: float = 0.0,
    max_queue: int = 256,
    max_request_bytes: int = 64 << 20,
    body_timeout_s: float = 30.0,
) -> FastAPI:
    """A FastAPI app serving `session` (a `kiln.Session`) as model `name`. Requests are batched
    up to `max_batch` samples; `max_delay_ms` 0 batches only what is already waiting, so a lone
    request runs at once. A request body must arrive whole within `body_timeout_s` of its
    headers."""
    settings = BatchSettings(max_batch, max_delay_ms, max_queue)
    models = ModelSet(settings=lambda source: settings)
    models.add(name, session, name)
    return create_models_app(
        models, max_request_bytes=max_request_bytes, body_timeout_s=body_timeout_s
    )


def create_models_app(
    models: ModelSet,
    *,
    max_request_bytes: int = 64 << 20,
    body_timeout_s: float = 30.0,
    before_close: Callable[[], None] | None = None,
) -> FastAPI:
    """A FastAPI app serving every model of `models`, each under its name; with a repository,
    the model_repository extension too. Stopping the app drains and closes every model, after
    `before_close` (the gRPC server beside it stopping, so it takes no request the models
    could no longer answer)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if before_close is not None:
            await run_in_threadpool(before_close)
        # uvicorn has already waited for requests in flight; this finishes anything still
        # queued (nothing, normally) before the engines are released.
        await run_in_threadpool(models.close)

    app = FastAPI(title="kiln serve", version=__version__, lifespan=lifespan)
    app.state.models = models
    _errors(app, models)
    _health_routes(app, models)
    _model_routes(app, models)
    _infer_route(app, models, max_request_bytes, body_timeout_s)
    app.add_middleware(
        InferFirst, models=models, limit=max_request_bytes, body_timeout_s=body_timeout_s
    )
    _kiln_routes(app, models, max_request_bytes)
    _repository_routes(app, models)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics_text(models), media_type=CONTENT_TYPE_LATEST)

    return app


def metrics_text(models: ModelSet) -> bytes:
    """/metrics: Kiln's own families (kiln_*, process_*) and Triton's (nv_inference_*)."""
    triton = models.metrics.triton.exposition().encode()
    return generate_latest(models.metrics.registry) + triton


def _errors(app: FastAPI, models: ModelSet) -> None:
    @app.exception_handler(Refused)
    async def refused(request: Request, exc: Refused) -> JSONResponse:
        return _refusal(exc)

    @app.exception_handler(ModelUnavailable)
    async def model_error(request: Request, exc: ModelUnavailable) -> JSONResponse:
        return _refusal(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Unknown routes and wrong methods, in KServe's error form too, saying what exists.
        where = f"{request.method} {clip(request.url.path)}"
        names = ", ".join(f"'{m.name}'" for m in models.served()) or "none now"
        message = {
            404: f"no endpoint {where}; this server answers POST /v2/models/MODEL/infer, "
            f"GET /v2/models/MODEL and the other KServe v2 paths for its models ({names}), "
            "and /metrics",
            405: f"{where}: method not allowed; use {(exc.headers or {}).get('Allow', 'another')}",
        }.get(exc.status_code, str(exc.detail))
        return JSONResponse({"error": message}, status_code=exc.status_code, headers=exc.headers)


def _refusal(exc: Refused | ModelUnavailable) -> JSONResponse:
    """A refused request's answer: KServe's error form, the connection closed after a 408."""
    headers = {"Connection": "close"} if exc.status == BODY_TIMEOUT else None
    return _answer({"error": str(exc)}, exc.status, headers)


def _answer(
    body: dict[str, Any], status: int, headers: dict[str, str] | None = None
) -> JSONResponse:
    """A JSON answer; a 503 with Retry-After."""
    if status == 503:
        headers = {**(headers or {}), "Retry-After": str(RETRY_AFTER_S)}
    return JSONResponse(body, status_code=status, headers=headers)


def _health_routes(app: FastAPI, models: ModelSet) -> None:
    @app.get("/v2/health/live")
    async def live() -> dict[str, bool]:
        return {"live": True}

    @app.get("/v2/health/ready")
    async def server_ready() -> JSONResponse:
        ready = models.ready()
        return _answer({"ready": ready}, 200 if ready else 503)

    @app.get("/v2")
    async def metadata() -> dict[str, Any]:
        return server_metadata(models)


def _model_routes(app: FastAPI, models: ModelSet) -> None:
    # Before /v2/models/{model}, which would take "stats" for a model's name.
    @app.get("/v2/models/stats")
    async def all_statistics() -> dict[str, Any]:
        return {"model_stats": [m.metrics.statistics.to_json() for m in models.served()]}

    @app.get("/v2/models/{model}/stats")
    @app.get("/v2/models/{model}/versions/{version}/stats")
    async def statistics(model: str, version: str | None = None) -> dict[str, Any]:
        return {"model_stats": [models.get(model, version).metrics.statistics.to_json()]}

    @app.get("/v2/models/{model}/config")
    @app.get("/v2/models/{model}/versions/{version}/config")
    async def configuration(model: str, version: str | None = None) -> dict[str, Any]:
        return models.get(model, version).config()

    @app.get("/v2/models/{model}")
    @app.get("/v2/models/{model}/versions/{version}")
    async def model_metadata(model: str, version: str | None = None) -> dict[str, Any]:
        return models.get(model, version).metadata()

    @app.get("/v2/models/{model}/ready")
    @app.get("/v2/models/{model}/versions/{version}/ready")
    async def model_ready(model: str, version: str | None = None) -> JSONResponse:
        ready = models.get(model, version).accepting
        return _answer({"name": model, "ready": ready}, 200 if ready else 503)


def _infer_route(app: FastAPI, models: ModelSet, limit: int, body_timeout_s: float) -> None:
    @app.post("/v2/models/{model}/infer")
    @app.post("/v2/models/{model}/versions/{version}/infer")
    async def infer(model: str, request: Request, version: str | None = None) -> Response:
        # Held to the answer: an unload or a newer version waits for this request to finish.
        with models.lease(model, version) as served:
            return await _infer(served, request, limit, body_timeout_s)


# The infer paths, as the routes above spell them ({model} and {version}: one path segment).
_INFER_PATH = re.compile(r"/v2/models/([^/]+)(?:/versions/([^/]+))?/infer")


class InferFirst:
    """Answers `POST .../infer` (the routes above) ahead of FastAPI's router, with the same
    `_infer` and the same refusals: routing through every route, solving the endpoint's
    parameters and the exception middleware cost a lone small request more of its time inside
    the app than decoding, running and encoding it ("Serving" in
    docs/contributing/engine-notes.md; benchmarks/serve_compare.py times a lone request).
    Everything else goes on to the app."""

    def __init__(self, app: ASGIApp, models: ModelSet, limit: int, body_timeout_s: float) -> None:
        self.app, self.models, self.limit, self.timeout = app, models, limit, body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        found = None
        if scope["type"] == "http" and scope["method"] == "POST":
            found = _INFER_PATH.fullmatch(scope["path"])
        if found is None:
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive)
        model, version = found.groups()
        if version is None and scope["query_string"]:  # the route takes ?version= too
            version = request.query_params.get("version")
        try:
            # Held to the answer: an unload or a newer version waits for this request.
            with self.models.lease(model, version) as served:
                response = await _infer(served, request, self.limit, self.timeout)
        except (Refused, ModelUnavailable) as exc:
            response = _refusal(exc)
        await response(scope, receive, send)


async def _infer(served: ServedModel, request: Request, limit: int, timeout: float) -> Response:
    """One inference request on `served`, in KServe's HTTP form: the body read within
    `timeout` and `limit`, decoded and encoded in a worker thread (they take milliseconds on
    large tensors, which the event loop must not wait on)."""
    size = 0

    async def read() -> bytes:
        nonlocal size
        try:
            body = await _read_body(request, limit, timeout)
        except ClientDisconnect:
            raise Refused(
                CLIENT_CLOSED, "the client closed the connection before sending the whole body"
            ) from None
        size = len(body)
        return body

    async def decode(body: bytes) -> InferRequest:
        if _small_body(body, request.headers):
            return _decode(body, request.headers, limit, served.inputs)
        return await run_in_threadpool(_decode, body, request.headers, limit, served.inputs)

    async def encode(decoded: InferRequest, outputs: dict) -> tuple[bytes, int | None]:
        binary = decoded.outputs or dict.fromkeys(outputs, decoded.binary_default)
        if small_answer(outputs, binary):
            return encode_response(served.name, decoded, outputs, served.version)
        return await run_in_threadpool(
            encode_response, served.name, decoded, outputs, served.version
        )

    try:
        content, json_length = await infer(served, read, decode, encode)
    except Refused:
        if size >= TRIM_ABOVE_BYTES:  # the request's arrays are gone: give their pages back
            await run_in_threadpool(trim_heap)
        raise
    if json_length is None:
        return Response(content, media_type="application/json")
    return Response(
        content,
        media_type="application/octet-stream",
        headers={"Inference-Header-Content-Length": str(json_length)},
    )


def _kiln_routes(app: FastAPI, models: ModelSet, max_request_bytes: int) -> None:
    @app.post("/v2/models/{model}/swap")
    async def swap(model: str, request: Request) -> dict[str, Any]:
        """Kiln's admin extension: build a bucket set (the current one afresh, or `buckets`,
        e.g. {"buckets": "batch=1,4,8 seq=32,64"}) in the background, verify it and swap it in
        while serving. Answers once swapped, or at once with {"wait": false}."""
        args = _swap_args(await request.body())
        with models.lease(model) as served:  # not retired while its buckets build
            session = served.session
            swaps = session.stats()["swaps"]
            try:
                await run_in_threadpool(
                    lambda: session.swap(
                        args.get("buckets"),
                        wait=bool(args.get("wait", True)),
                        max_bytes=max_request_bytes * served.batcher.max_batch,
                    )
                )
            except (KilnError, TypeError, ValueError) as exc:  # TypeError: {"batch": 4}, not [4]
                raise Refused(400, str(exc)) from None
            stats = session.stats()
        return {"name": model, "swapped": stats["swaps"] > swaps, "stats": stats}

    @app.get("/v2/models/{model}/runtime")
    async def runtime(model: str) -> dict[str, Any]:
        """Kiln's extension: the session's buckets, per-bucket figures and every decision."""
        return models.get(model).stats()


def _swap_args(body: bytes) -> dict[str, Any]:
    try:
        args = json.loads(body) if body.strip() else {}
    except (ValueError, RecursionError) as exc:
        raise Refused(400, f"malformed JSON in the request: {exc}") from None
    if (
        not isinstance(args, dict)
        or set(args) - {"buckets", "wait"}
        or not isinstance(args.get("buckets"), str | dict | None)
        or not isinstance(args.get("wait", True), bool)
    ):
        raise Refused(400, 'the body must be {} or {"buckets": "batch=1,4 seq=32", "wait": true}')
    return args


def _repository_routes(app: FastAPI, models: ModelSet) -> None:
    """Triton's model_repository extension: index, load, unload. Loads and unloads run in a
    worker thread, so the event loop (every other model's requests) never waits on them."""

    @app.post("/v2/repository/index")
    async def index(request: Request) -> list[dict[str, str]]:
        args = _repository_args(await request.body(), {"ready": bool}, "index")
        # Every server answers it, as Triton's: the models it serves (a client lists first).
        return models.index(ready_only=bool(args.get("ready", False)))

    @app.post("/v2/repository/models/{model}/load")
    async def load(model: str, request: Request) -> JSONResponse:
        params = _repository_args(await request.body(), {"parameters": dict}, "load")
        models.need_repository("load")  # no repository: what a parameter would change is moot
        check_load_parameters(list(params.get("parameters") or {}))
        await repository_change(models.load, model)
        return JSONResponse({})

    @app.post("/v2/repository/models/{model}/unload")
    async def unload(model: str, request: Request) -> JSONResponse:
        params = _repository_args(await request.body(), {"parameters": dict}, "unload")
        check_unload_parameters(list(params.get("parameters") or {}))
        await repository_change(models.unload, model)
        return JSONResponse({})


def _repository_args(body: bytes, fields: dict[str, type], call: str) -> dict[str, Any]:
    """The optional JSON body of a repository call: an object with at most `fields`."""
    try:
        args = json.loads(body) if body.strip() else {}
    except (ValueError, RecursionError) as exc:
        raise Refused(400, f"malformed JSON in the {call} request: {exc}") from None
    wrong = not isinstance(args, dict) or any(
        key not in fields or not isinstance(value, fields[key]) for key, value in args.items()
    )
    if wrong:
        shape = ", ".join(f'"{k}": {t.__name__}' for k, t in fields.items())
        raise Refused(400, f"the {call} request body must be empty or {{{shape}}}")
    return args


async def _read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The body, refused with 413 as soon as it is known to pass `limit` bytes, and with 408 if
    it is not whole within `timeout` seconds: a client that promises bytes and stalls must not
    hold a request (and its slot in the server) forever."""
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise RequestTooLarge(limit)

    async def read() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise RequestTooLarge(limit)
            chunks.append(chunk)
        return b"".join(chunks)

    try:
        return await asyncio.wait_for(read(), timeout)  # not asyncio.timeout: Python 3.10
    except asyncio.TimeoutError:
        raise BodyTimeout(timeout) from None


def _small_body(body: bytes, headers: Any) -> bool:
    """Whether decoding `body` is cheap enough for the event loop (service.INLINE_BYTES):
    uncompressed, small, and its JSON (the part parsed element by element) a few KiB."""
    if headers.get("content-encoding", "identity") != "identity" or len(body) > INLINE_BYTES:
        return False
    try:
        json_bytes = header_length(headers.get("inference-header-content-length")) or len(body)
    except ProtocolError:
        return True  # refused at once, wherever it is decoded
    return json_bytes <= INLINE_JSON_BYTES


# A request's JSON up to this size parses on the event loop: a header naming binary tensors is
# a few hundred bytes (bert-tiny's: 0.7 KB, all three inputs); JSON `data` parses at ~0.2 ms
# per KiB on this 2-core machine under load, so 1 KiB of it holds the loop no longer.
INLINE_JSON_BYTES = 1 << 10


def _decode(body: bytes, headers: Any, limit: int, names: Collection[str]) -> InferRequest:
    body = decompress(body, headers.get("content-encoding"), limit)
    length = header_length(headers.get("inference-header-content-length"))
    return parse_request(body, length, names)
