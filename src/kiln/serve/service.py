"""What HTTP and gRPC answer alike: the server's metadata, the checks on a repository call, and
an inference request's path through a model — decoded, checked against the model, queued in
its batcher, run, encoded, counted — so that the two protocols cannot drift apart. Each
protocol brings only its wire format (`read`, `decode`, `encode`) and its way of saying an error.

A refusal is `Refused(status, message)` with `status` an HTTP status, the one `kiln serve`
answers over HTTP; gRPC answers the code Triton gives the same failure (grpc_service.py).
Metrics and statistics count failures by that status whichever protocol carried them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from kiln import __version__
from kiln.errors import KilnError
from kiln.runtime.batcher import Closed, Overloaded
from kiln.serve.metrics import TimedFeeds
from kiln.serve.models import ModelSet, ModelUnavailable, ServedModel
from kiln.serve.protocol import InferRequest, RequestTooLarge
from kiln.wire import ProtocolError, clip, datatype_of, not_text, unknown_input

log = logging.getLogger("uvicorn.error")  # configured by uvicorn, so it reaches the console
# The protocol extensions served: each one a client may rely on.
EXTENSIONS = ["binary_tensor_data", "model_configuration", "statistics"]
# Nginx's code for "the client closed the connection before the answer": counted, never sent.
CLIENT_CLOSED = 499

# A request or answer this small is decoded or encoded on the event loop: a worker thread costs
# two hand-offs, each a wake-up that waits for a core (on 2 busy cores a lone resnet-tiny
# request spent more in them than in decoding and encoding, 15–65 µs here). Binary tensors
# are copied at ~0.5 µs per KiB, so INLINE_BYTES of them take ~30 µs; a JSON or BYTES element
# costs ~1.4 µs, so at most INLINE_ELEMENTS of those. Larger ones go to a worker, where a
# megabyte's decoding cannot hold up every other request on the loop.
INLINE_BYTES = 64 << 10
INLINE_ELEMENTS = 32

Raw = TypeVar("Raw")  # a request as the wire gave it: an HTTP body, a gRPC message
Answer = TypeVar("Answer")  # an answer as the wire takes it


class Refused(Exception):
    """A request answered with an error: `status` is its HTTP status, the message says what
    was wrong and what to do."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def server_metadata(models: ModelSet) -> dict[str, Any]:
    """KServe's server metadata: name, version and the extensions served (a repository adds
    model_repository)."""
    extensions = EXTENSIONS + (["model_repository"] if models.repository else [])
    return {"name": "kiln", "version": __version__, "extensions": extensions}


# Loads and unloads run on threads of their own: an unload blocks its thread until the model's
# requests are answered, and those answers need the shared pools' threads to encode them — a
# burst of unloads on the shared pool (asyncio's has 6 threads on 2 cores) would starve the
# very answers they wait for. Two at once; more wait their turn here, off the event loop.
_REPOSITORY_CHANGES = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kiln-repository")


async def repository_change(change: Callable[[str], object], model: str) -> None:
    """`models.load` or `models.unload` of `model`, off the event loop and off the pools that
    decode and encode requests."""
    await asyncio.get_running_loop().run_in_executor(_REPOSITORY_CHANGES, change, model)


def check_load_parameters(names: list[str]) -> None:
    """Triton's load takes "config" and "file:" overrides; a Kiln model brings its own."""
    if names:
        raise Refused(
            400,
            f"load parameter {clip(sorted(names)[0])} is not taken: kiln serve loads a model as "
            "its repository folder holds it; change the folder and load again",
        )


def check_unload_parameters(names: list[str]) -> None:
    unknown = sorted(set(names) - {"unload_dependents"})
    if unknown:
        raise Refused(400, f"unload parameter {clip(unknown[0])} is not taken")


async def infer(
    served: ServedModel,
    read: Callable[[], Awaitable[Raw]],
    decode: Callable[[Raw], Awaitable[InferRequest]],
    encode: Callable[[InferRequest, dict[str, np.ndarray]], Awaitable[Answer]],
) -> Answer:
    """One inference request on `served`: `read` it off the wire, `decode` it into tensors
    (Triton's compute_input: decoding and the checks), check it against the model, run it in
    the batch it joins, `encode` the outputs (compute_output). Counted once in the model's
    metrics and statistics, answered or not. A failure raises `Refused`."""
    metrics, batcher = served.metrics, served.batcher
    started = time.perf_counter()
    metrics.requests.inc()
    failure, raw, decoded, feeds = None, None, None, None
    # Until the answer is made: a request cut off (cancelled) is counted as the client's.
    status: int | None = CLIENT_CLOSED
    try:
        if batcher.full():  # refuse before reading a body we could not queue anyway
            raise Overloaded(
                f"server overloaded: {batcher.depth} requests are queued for model "
                f"'{served.name}' (the limit, kiln serve --max-queue); retry later"
            )
        raw = await read()
        read_at = time.perf_counter()
        decoded = await decode(raw)
        feeds = _checked(served, decoded)
        feeds.submitted = time.perf_counter()
        feeds.decode_s = feeds.submitted - read_at
        values = await _run(served, feeds)
        outputs = dict(zip(served.output_names, values, strict=True))
        answered = time.perf_counter()
        answer = await encode(decoded, outputs)
        feeds.encode_s = time.perf_counter() - answered
        status = None
    except Exception as exc:
        status, message = status_of(exc)
        if status == 500:  # not the client's fault: keep the traceback for the operator
            log.exception("inference failed")
        failure = Refused(status, message)
    finally:
        # Counted before the answer leaves: a client holding it finds it in /stats.
        metrics.answered(time.perf_counter() - started, status, feeds)
    if failure is not None:  # raised here, past the except: no frame keeps the request
        raw = decoded = feeds = None  # noqa: F841 (the request's memory goes first)
        raise failure
    return answer


async def _run(served: ServedModel, feeds: TimedFeeds) -> list[np.ndarray]:
    """The request's outputs from the batch it joins. Where the engine refuses a request
    with an empty dim, the refusal names the input and the sizes it takes, not the engine's
    node that failed on it."""
    try:
        # In this thread only for a request alone in the server: with others in flight the
        # loop is better spent reading and decoding them while a worker runs this one (4
        # clients over HTTP, everything on the loop: 0.39x Triton's throughput, no more than
        # 1 client had).
        done = served.batcher.run_now(feeds) if served.in_flight <= 1 else None
        if done is not None:  # ran in this thread: its answer is in, no hand-off to wait for
            return done.result()
        return await asyncio.wrap_future(served.batcher.submit(feeds))
    except KilnError as exc:
        raise _empty_dim(served, feeds) or exc from None


def _empty_dim(served: ServedModel, feeds: TimedFeeds) -> Refused | None:
    """A 400 naming the first input with a dim of size 0, and the sizes that dim takes."""
    for name, array in feeds.items():
        if 0 not in array.shape:
            continue
        axis = array.shape.index(0)
        spec = served.inputs.get(name, {})
        most = (spec.get("max_shape") or [-1] * array.ndim)[axis]
        sizes = f"1 to {most}" if most > 0 else "at least 1"
        return Refused(
            400,
            f"input '{name}' has shape {list(array.shape)}: dim {axis} is empty, and the model "
            f"cannot run on it; give it {sizes} along dim {axis}",
        )
    return None


def small_answer(outputs: dict[str, np.ndarray], binary: dict[str, bool]) -> bool:
    """Whether encoding the `binary` (name → sent binary?) of `outputs` is cheap enough for the
    event loop (see INLINE_BYTES)."""
    size = elements = 0
    for name, raw in binary.items():
        array = outputs.get(name)
        if array is None:
            continue
        if raw and array.dtype.kind not in "OUS":
            size += array.nbytes
        else:
            elements += array.size
    return size <= INLINE_BYTES and elements <= INLINE_ELEMENTS


def _checked(served: ServedModel, request: InferRequest) -> TimedFeeds:
    """The request's tensors, checked against the model: the protocol's view (names,
    datatypes, shapes), then the model's own (dims within its limits), before queueing — a
    request the engine would fail on must neither run nor fail the batch it would join."""
    check_inputs(request.inputs, served.inputs)
    for name in served.text_inputs:  # ONNX strings are text: bytes that are not are refused
        why = not_text(request.inputs[name], f"input '{name}'")
        if why:
            raise Refused(400, why)
    check_batch(request.inputs, served)
    check_ids(request.inputs, served.vocabularies)
    feeds = TimedFeeds(served.session.check_feeds(request.inputs))
    unknown = sorted(set(request.outputs) - set(served.output_names))
    if unknown:
        raise Refused(
            400, f"unknown output {clip(unknown[0])}; the model's outputs are {served.output_names}"
        )
    return feeds


def check_inputs(feeds: dict[str, np.ndarray], specs: dict[str, dict[str, Any]]) -> None:
    """Names, datatypes, ranks and fixed dims against the model's inputs; 400 naming the input
    and what it should be. Also one batch size across inputs, which batching relies on."""
    unknown = sorted(set(feeds) - set(specs))
    if unknown:
        raise Refused(400, unknown_input(unknown[0], specs))
    for spec in specs.values():
        want = f"{spec['datatype']} with shape {spec['shape']} (-1: any size)"
        array = feeds.get(spec["name"])
        if array is None:
            raise Refused(400, f"missing input '{spec['name']}': expected {want}")
        datatype = datatype_of(array)
        if datatype != spec["datatype"]:
            raise Refused(400, f"input '{spec['name']}' has datatype {datatype}, expected {want}")
        shape = spec["shape"]
        if len(array.shape) != len(shape) or any(
            w >= 0 and g != w for g, w in zip(array.shape, shape, strict=True)
        ):
            raise Refused(
                400, f"input '{spec['name']}' has shape {list(array.shape)}, expected {want}"
            )
    batched = {k: v.shape[0] for k, v in feeds.items() if v.ndim and specs[k]["shape"][0] < 0}
    if len(set(batched.values())) > 1:
        raise Refused(
            400, f"inputs disagree on the batch size (dim 0): {batched}; give them all the same"
        )


def check_batch(feeds: dict[str, np.ndarray], served: ServedModel) -> None:
    """A request's batch (dim 0) within the max_batch_size /config advertises, as Triton
    refuses it: a larger one would run whole, its memory unbounded by anything the server
    says. A batch of 0 is refused too: it holds no sample, yet would run the engine and be
    counted as a batch. A model without a batch axis (max_batch_size 0) takes each request as
    it is."""
    limit = served.max_batch_size
    if not limit:
        return
    for name, array in feeds.items():
        if array.ndim and not 1 <= array.shape[0] <= limit:
            raise Refused(
                400,
                f"input '{name}' has batch size {array.shape[0]} (dim 0); model "
                f"'{served.name}' takes 1 to {limit} per request (its max_batch_size); "
                f"send 1 to {limit} per request",
            )


def check_ids(feeds: dict[str, np.ndarray], vocabularies: dict[str, int]) -> None:
    """Token ids within the model's vocabulary (`ServedModel.vocabularies`): 400 naming the
    input, the id and the range, before the engine fails on it (or reads a negative id from
    the table's end)."""
    for name, rows in vocabularies.items():
        ids = feeds.get(name)
        if ids is None or not ids.size:
            continue
        low, high = ids.min(), ids.max()
        if low < 0 or high >= rows:
            bad = low if low < 0 else high
            raise Refused(
                400,
                f"input '{name}' holds id {bad}; the model takes ids 0 to {rows - 1} (its "
                f"embedding table has {rows} rows)",
            )


def status_of(exc: Exception) -> tuple[int, str]:
    """The HTTP status and message a failure is answered with."""
    if isinstance(exc, Refused | ModelUnavailable):
        return exc.status, str(exc)
    if isinstance(exc, ProtocolError | KilnError):
        return 400, str(exc)
    if isinstance(exc, RequestTooLarge):
        return 413, str(exc)
    if isinstance(exc, Overloaded | Closed):
        return 503, str(exc)
    return 500, f"inference failed: {type(exc).__name__}: {exc}"
