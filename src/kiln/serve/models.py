"""The models one server serves: each its own session, batcher, metrics and statistics
(`ServedModel`), and the set of them (`ModelSet`) that requests look up and that loads, reloads
and unloads models while the others keep serving.

No lock is held while a model loads or drains: a load builds the new session off every
request's path (in the caller's thread) and swaps it in under the set's lock, a single dict
assignment. A request holds a lease on the model it looked up until it is answered, so a model
swapped out or unloaded is retired only once its requests are done: then its batcher answers
everything still queued and its engine is released. Loads of one model are serialised (a
second waits for the first); loads of different models run side by side.

States are Triton's: READY (served), LOADING (a first load under way; a reload leaves the old
version READY until the new one is in), UNAVAILABLE (unloaded, or the load failed: `reason`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import numpy as np

from kiln.errors import KilnError
from kiln.runtime.batcher import Batcher
from kiln.serve.metrics import ServeMetrics, ServerMetrics, engine_runs
from kiln.serve.protocol import model_config
from kiln.serve.repository import Repository, served_settings
from kiln.wire import clip

log = logging.getLogger("uvicorn.error")  # configured by uvicorn, so it reaches the console

READY, LOADING, UNAVAILABLE = "READY", "LOADING", "UNAVAILABLE"
# The version a model given by file is served as: the protocol wants a version to name.
FILE_VERSION = "1"


class ModelUnavailable(Exception):
    """What a request about a model cannot have; `status` is the HTTP answer (404: no such
    model or version, 400: a load that failed or a repository call without a repository,
    503: the model is still loading)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class BatchSettings:
    """One model's batcher: samples per batch, the longest wait for company, queue length;
    and what a config.pbtxt may set besides (see repository.py): the batch sizes that go at
    once, whether requests are batched together at all, whether the model is served with a
    batch dim (max_batch_size 0: not), batches run side by side, and the (platform, backend)
    it names where that is what runs."""

    max_batch: int = 16
    max_delay_ms: float = 0.0
    max_queue: int = 256
    preferred: tuple[int, ...] = ()
    combine: bool = True
    batching: bool = True
    workers: int = 1
    engine: tuple[str, str] | None = None
    shapes: dict[str, list[int]] | None = None  # inputs' shapes as the config narrows them


class ServedModel:
    """One version of a model being served: its session (a `kiln.Session`), its batcher
    (running from construction) and its metrics. `retire` ends it."""

    def __init__(
        self,
        name: str,
        version: str,
        source: str,
        session: Any,
        settings: BatchSettings,
        metrics: ServeMetrics,
    ) -> None:
        self.name, self.version, self.source, self.session = name, version, source, session
        self.metrics = metrics
        self.batch_axis = _has_batch_axis(session) and settings.batching
        self.batcher = Batcher(
            metrics.executions(session.run_batch, engine_runs(session), self.batch_axis),
            max_batch=settings.max_batch,
            max_delay=settings.max_delay_ms / 1000,
            max_queue=settings.max_queue,
            preferred=settings.preferred,
            combine=settings.combine,
            workers=settings.workers,
        )
        self.inputs = {spec["name"]: _shaped(spec, settings.shapes) for spec in session.inputs}
        self.output_names = list(session.output_names)
        self.vocabularies = vocabularies(session)
        self.text_inputs = [a.name for a in session.get_inputs() if a.type == "tensor(string)"]
        self.platform, self.backend, self.kind = _engine(session.get_providers())
        if settings.engine is not None:  # the config's name for what runs (Python backend)
            self.platform, self.backend = settings.engine
        self._users = 0
        self._idle = threading.Condition()
        self.batcher.start()

    @property
    def depth(self) -> int:
        return self.batcher.depth

    @property
    def accepting(self) -> bool:
        return self.batcher.accepting

    @property
    def in_flight(self) -> int:
        """Requests holding the model now: looked up, not yet answered (`enter`, `leave`)."""
        return self._users

    @property
    def max_batch_size(self) -> int:
        """Triton's max_batch_size as /config advertises it: the most samples one request may
        bring (and the batcher merges); 0 for a model without a batch axis on every tensor."""
        return self.batcher.max_batch if self.batch_axis else 0

    def stats(self) -> dict[str, Any]:
        return self.session.stats()

    def metadata(self) -> dict[str, Any]:
        """KServe's model metadata."""
        return {
            "name": self.name,
            "versions": [self.version],
            "platform": self.platform,  # as /config says, as Triton does
            "inputs": list(self.inputs.values()),
            "outputs": list(self.session.outputs),
        }

    def config(self) -> dict[str, Any]:
        """Triton's ModelConfig, with the batcher's settings as they are now."""
        config = model_config(
            self.name, list(self.inputs.values()), list(self.session.outputs),
            platform=self.platform, backend=self.backend, kind=self.kind,
            max_batch_size=self.max_batch_size,
            max_delay_s=self.batcher.max_delay,
        )  # fmt: skip
        return _scheduled(config, self.batcher)

    def enter(self) -> None:
        with self._idle:
            self._users += 1

    def leave(self) -> None:
        with self._idle:
            self._users -= 1
            if not self._users:
                self._idle.notify_all()

    def retire(self) -> None:
        """Wait for the requests holding it, answer everything queued, release the engine.
        Called once nothing can look it up any more."""
        with self._idle:
            while self._users:
                self._idle.wait()
        self.batcher.close()
        close = getattr(self.session, "close", None)
        if close is not None:
            close()


@dataclass
class _Entry:
    """A model's place in the set: its state, and what serves it (None unless READY)."""

    state: str
    version: str = ""
    reason: str = ""
    model: ServedModel | None = None

    def row(self, name: str) -> dict[str, str]:
        """Its line in Triton's repository index."""
        return {"name": name, "version": self.version, "state": self.state, "reason": self.reason}


# A model's source (artifact, .onnx, zoo:NAME) → a kiln.Session; `backend=` (Kiln's engine
# name) is passed only where a config.pbtxt names the engine of a plain model file.
Opener = Callable[..., Any]


def _open_session(source: str, backend: str | None = None) -> Any:
    from kiln.runtime import Session  # seconds of engine imports: only when a model is opened

    return Session(source, backend=backend)


class ModelSet:
    """The models a server serves, by name. `open_session` opens a source as a `kiln.Session`
    and `settings` gives its batcher's; with a `repository`, models load from it and the
    model_repository calls (`index`, `load`, `unload`) work."""

    def __init__(
        self,
        open_session: Opener | None = None,
        settings: Callable[[str], BatchSettings] | None = None,
        repository: Repository | None = None,
    ) -> None:
        self._open = open_session or _open_session
        self._settings = settings or (lambda source: BatchSettings())
        self.repository = repository
        self.metrics = ServerMetrics(self.served)
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self._loads: dict[str, threading.Lock] = {}  # per model: one load or unload at a time
        self._retiring: list[threading.Thread] = []
        self._closed = False
        self._quiet = False  # while the repository loads at start-up: see load_repository

    # ------------------------------------------------------------ serving

    def served(self) -> list[ServedModel]:
        """The models served now, by name."""
        with self._lock:
            return [e.model for _, e in sorted(self._entries.items()) if e.model is not None]

    def get(self, name: str, version: str | None = None) -> ServedModel:
        """The model served as `name` (at `version`, if given); ModelUnavailable if none."""
        with self._lock:
            return self._find(name, version)

    @contextmanager
    def lease(self, name: str, version: str | None = None) -> Iterator[ServedModel]:
        """The model served as `name`, held until the block ends: it is not retired (an unload,
        or a newer version swapped in) while a request is using it."""
        with self._lock:
            model = self._find(name, version)
            model.enter()
        try:
            yield model
        finally:
            model.leave()

    def ready(self) -> bool:
        """Whether the server is ready: no model is on its first load and every model served
        takes requests. A model that failed to load or was unloaded does not hold it back (the
        index says why it is UNAVAILABLE)."""
        with self._lock:
            entries = list(self._entries.values())
        return not self._closed and all(
            e.state != LOADING and (e.model is None or e.model.accepting) for e in entries
        )

    def _find(self, name: str, version: str | None) -> ServedModel:
        """Under the lock."""
        entry = self._entries.get(name)
        if entry is None or entry.model is None:
            raise self._not_served(name, entry)
        model = entry.model
        if version is not None and version != model.version:
            raise ModelUnavailable(
                404,
                f"model '{name}' has no version {clip(version)}; it serves version "
                f"'{model.version}'",
            )
        return model

    def _not_served(self, name: str, entry: _Entry | None) -> ModelUnavailable:
        """Under the lock. Triton answers NOT_FOUND (HTTP 404) for a model it does not serve,
        unloaded or never loaded; one still on its first load is UNAVAILABLE (503)."""
        if entry is not None and entry.state == LOADING:
            return ModelUnavailable(
                503,
                f"model '{name}' is loading; retry once GET /v2/models/{name}/ready answers 200",
            )
        served = self._served_text()
        if entry is None and not (self.repository and self.repository.has(name)):
            return ModelUnavailable(404, f"unknown model {clip(name)}; {served}")
        why = entry.reason if entry is not None else "in the repository, never loaded"
        failed = entry is not None and "failed to load" in entry.reason
        return ModelUnavailable(
            404,
            f"model '{name}' is not loaded ({why}); a repository load (HTTP POST "
            f"/v2/repository/models/{name}/load, gRPC RepositoryModelLoad) loads it"
            f"{' once that is mended' if failed else ''}; {served}",
        )

    def _served_text(self) -> str:
        names = [f"'{n}'" for n, e in sorted(self._entries.items()) if e.model is not None]
        return f"this server serves {', '.join(names)}" if names else "it serves no model now"

    # ------------------------------------------------------------ starting

    def add(self, name: str, session: Any, source: str, version: str = FILE_VERSION) -> None:
        """Serve `session`, already open, as model `name`."""
        if name in self._entries:  # before the batcher starts: nothing to undo
            raise KilnError(
                f"two models would be served as '{name}' ({source} and another); serve one, "
                "or rename one of the files"
            )
        model = ServedModel(
            name, version, source, session, self._settings(source),
            self.metrics.model(name, version),
        )  # fmt: skip
        with self._lock:
            self._entries[name] = _Entry(READY, version, "", model)

    def open(self, name: str, source: str) -> None:
        """Open `source` and serve it as `name`; KilnError naming it if it cannot be opened."""
        self.add(name, self._open(source), source)

    def load_repository(self, workers: int = 2) -> list[dict[str, str]]:
        """Load every model of the repository, `workers` at a time; one that fails is
        UNAVAILABLE with its reason and the others serve. The index, once done."""
        names = self.need_repository("load").names()
        self._quiet = True  # a failure is said once, by its index line, which the caller shows
        try:
            with ThreadPoolExecutor(max(1, min(workers, len(names)))) as pool:
                list(pool.map(self._try_load, names))
        finally:
            self._quiet = False
        return self.index()

    def _try_load(self, name: str) -> None:
        with suppress(ModelUnavailable):  # its entry says why
            self.load(name)

    # ------------------------------------------------------------ the model_repository calls

    def index(self, ready_only: bool = False) -> list[dict[str, str]]:
        """Triton's repository index: every model of the repository (or served), by name."""
        with self._lock:
            rows = {name: entry.row(name) for name, entry in self._entries.items()}
        if self.repository is not None:
            for name in self.repository.names():
                rows.setdefault(name, _Entry(UNAVAILABLE, reason="never loaded").row(name))
        listed = [rows[name] for name in sorted(rows)]
        return [r for r in listed if r["state"] == READY] if ready_only else listed

    def load(self, name: str) -> dict[str, str]:
        """Load the highest version of `name` from the repository, or reload it: the new
        session is built while the old version (if any) keeps serving, and swapped in once
        built. A failure leaves the old version serving. The model's index line, once in."""
        repository = self.need_repository("load")
        if not repository.has(name):
            listed = ", ".join(f"'{n}'" for n in repository.names()) or "none"
            raise ModelUnavailable(
                404, f"unknown model {clip(name)}: no such folder in the repository "
                f"{repository.root} (its models: {listed})",
            )  # fmt: skip
        with self._load_lock(name):
            self._loading(name)
            try:
                found = repository.latest(name)
                version, source = found.version, found.source
            except KilnError as exc:
                raise self._failed(name, None, str(exc)) from None
            try:
                backend = found.backend
                session = self._open(source, backend=backend) if backend else self._open(source)
            except Exception as exc:
                raise self._failed(name, version, _reason(exc, source)) from None
            try:
                settings = served_settings(
                    found, self._settings(source), session, _has_batch_axis(session),
                    _engine(session.get_providers()),
                )  # fmt: skip
                model = ServedModel(
                    name, version, source, session, settings, self.metrics.model(name, version)
                )
            except Exception as exc:
                session.close()
                raise self._failed(name, version, _reason(exc, source)) from None
            self._swap_in(name, model)
            with self._lock:
                return self._entries[name].row(name)

    def unload(self, name: str) -> None:
        """Stop serving `name`: new requests for it are refused (404) at once, those already
        taken are answered, then its engine is released. Returns once it is drained."""
        repository = self.need_repository("unload")
        with self._lock:
            if name not in self._entries and not repository.has(name):
                raise self._not_served(name, None)
        with self._load_lock(name):
            with self._lock:
                entry = self._entries.setdefault(name, _Entry(UNAVAILABLE))
                model, entry.model = entry.model, None
                entry.state, entry.reason = UNAVAILABLE, "unloaded"
            if model is not None:  # unloading what is not loaded succeeds, as in Triton
                model.retire()

    def need_repository(self, call: str) -> Repository:
        """The repository; ModelUnavailable (400) saying a `call` of the extension needs one."""
        if self.repository is None:
            raise ModelUnavailable(
                400,
                f"the model_repository extension ({call}) needs a repository; start kiln "
                "serve with --model-repository DIR to load and unload models while serving",
            )
        return self.repository

    def _load_lock(self, name: str) -> threading.Lock:
        with self._lock:
            return self._loads.setdefault(name, threading.Lock())

    def _loading(self, name: str) -> None:
        """Mark a first load; a model already served stays READY while its next version loads."""
        with self._lock:
            entry = self._entries.setdefault(name, _Entry(UNAVAILABLE))
            if entry.model is None:
                entry.state, entry.reason = LOADING, ""

    def _failed(self, name: str, version: str | None, reason: str) -> ModelUnavailable:
        """Record a failed load; the 400 to answer, saying whether an older version serves."""
        what = f"'{name}'" + (f" version {version}" if version else "")
        reason = reason.rstrip(".")  # a sentence of its own no longer: more follows
        with self._lock:
            entry = self._entries[name]
            if entry.model is not None:
                tried = f"version {version}" if version else "the last load"
                entry.reason = f"{tried} failed to load: {reason}"
                keeps = f"; version {entry.model.version} keeps serving"
            else:
                entry.state, entry.version, entry.reason = UNAVAILABLE, version or "", reason
                keeps = ""
        if not self._quiet:
            log.warning("failed to load %s: %s%s", what, reason, keeps)
        return ModelUnavailable(400, f"failed to load {what}: {reason}{keeps}")

    def _swap_in(self, name: str, model: ServedModel) -> None:
        with self._lock:
            entry = self._entries[name]
            old, entry.model = entry.model, model
            entry.state, entry.version, entry.reason = READY, model.version, ""
            closed = self._closed
        if closed:  # the server stopped while this loaded: nothing will serve it
            self._retire(model)
        if old is not None:  # off this call's path: its requests may take a while to finish
            thread = threading.Thread(target=old.retire, name=f"kiln-retire-{name}", daemon=True)
            thread.start()
            with self._lock:
                self._retiring = [t for t in self._retiring if t.is_alive()] + [thread]

    def _retire(self, model: ServedModel) -> None:
        with self._lock:
            entry = self._entries.get(model.name)
            if entry is not None and entry.model is model:
                entry.model, entry.state, entry.reason = None, UNAVAILABLE, "server stopped"
        model.retire()

    # ------------------------------------------------------------ stopping

    def close(self) -> None:
        """Stop serving: every model answers what it has queued, then releases its engine."""
        with self._lock:
            self._closed = True
            models = [e.model for e in self._entries.values() if e.model is not None]
            retiring = list(self._retiring)
        for model in models:
            self._retire(model)
        for thread in retiring:
            thread.join()


def _reason(exc: Exception, source: str) -> str:
    """Why a load failed, for the client: Kiln's own messages name the file and the fix; any
    other failure is named by its type, its traceback kept for the operator."""
    if isinstance(exc, KilnError):
        return str(exc)
    log.exception("loading %s failed", source)
    return f"{source}: {type(exc).__name__}: {exc}"


_GPU_PROVIDERS = (":GPU", "CUDAExecutionProvider", "TensorrtExecutionProvider")


def _shaped(spec: dict[str, Any], shapes: dict[str, list[int]] | None) -> dict[str, Any]:
    """An input's metadata with the shape a config.pbtxt narrowed it to, if it did."""
    shape = (shapes or {}).get(spec["name"])
    return spec if shape is None else {**spec, "shape": shape}


def _scheduled(config: dict[str, Any], batcher: Batcher) -> dict[str, Any]:
    """`config` with what a config.pbtxt may set of the batcher: no dynamic_batching where
    requests run alone, its preferred sizes, its instance count."""
    for group in config["instance_group"]:
        group["count"] = batcher.workers
    if not batcher.combine:
        config.pop("dynamic_batching", None)
    elif batcher.preferred and "dynamic_batching" in config:
        config["dynamic_batching"]["preferred_batch_size"] = list(batcher.preferred)
    return config


def vocabularies(session: Any) -> dict[str, int]:
    """Per integer input that indexes an embedding table (token ids), the table's rows: a
    request's ids must lie in [0, rows). The engine would name its Gather node for one past
    the end, and silently read from the end for a negative one."""
    from kiln.ir.inputs import _vocab_size  # the rule input synthesis uses: the two agree

    model = getattr(session, "interface", None)
    if model is None:
        return {}
    found = {}
    for value in model.graph.inputs:
        dtype = value.dtype.numpy() if value.dtype is not None else None
        if dtype is not None and np.issubdtype(dtype, np.integer):
            rows = _vocab_size(value)
            if rows:
                found[value.name] = rows
    return found


def _has_batch_axis(session: Any) -> bool:
    """Whether every input and output leads with the model's batch dim: what Triton's
    max_batch_size > 0 says of a model (its `dims` then leave that dim out)."""
    batch = set(session.batch_dims)
    values = [*session.get_inputs(), *session.get_outputs()]
    return bool(batch) and all(v.shape and v.shape[0] in batch for v in values)


def _engine(providers: list[str]) -> tuple[str, str, str]:
    """Triton's platform, backend and instance kind for the engine a session runs on, from its
    providers (["CPUExecutionProvider"], ["OpenVINO:CPU"], ...). A partitioned model runs on
    several engines at once, which no Triton backend does: Kiln's runtime runs it."""
    gpu = any(p.endswith(_GPU_PROVIDERS) for p in providers)
    kind = "KIND_GPU" if gpu else "KIND_CPU"
    if any(p.startswith("kiln:") for p in providers):  # Kiln's own runtime (a pipeline)
        return "", "kiln", kind
    openvino = [p for p in providers if p.startswith("OpenVINO")]
    if openvino and len(openvino) < len(providers):
        return "", "kiln", kind
    if openvino:
        return "openvino", "openvino", kind
    return "onnxruntime_onnx", "onnxruntime", kind
