"""A model run here: `kiln.Session(path).run(output_names, feeds)`, like an ONNX Runtime
InferenceSession, with shape buckets, a load monitor, background recompilation and hot swap.

A request's shape is routed to the smallest bucket holding it, padded up (where padding was
checked safe, see padding.py), run on a shape-specialised executable and its outputs sliced
back. Shapes no bucket holds run on the dynamic executable and count as misses. A swap (see
rebuild.py) replaces the whole bucket set with one reference assignment: a request reads
`self._state` once, so it runs on one consistent set and requests in flight finish on the
old executables. Opening the source is source.py; merging requests is batching.py.

The request path costs next to nothing over the engine's own run: the checks of a request
(names, dtypes, shapes, each dim within the model's limit, see limits.py) run once per
signature (every input's name, dtype and shape) and their verdict is kept; the load monitor
takes one append (monitor.py). ONNX Runtime's own arguments (providers, sess_options,
run_options) are read by ort_args.py.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from kiln.backends import Executable, get_backend, join_company, leave_company, options_from_json
from kiln.errors import KilnError
from kiln.ir.inputs import input_bytes, synthesize
from kiln.runtime import batching, records
from kiln.runtime import buckets as bk
from kiln.runtime.adaptive import AdaptivePolicy, Trigger, TriggerKind
from kiln.runtime.arguments import checked_feeds, output_list
from kiln.runtime.bucketset import BucketSet, executable_cap
from kiln.runtime.limits import check_limits, dim_limits, max_shape
from kiln.runtime.metadata import (
    ModelMetadata,
    NodeArg,
    graph_inputs,
    kserve_meta,
    model_metadata,
    node_arg,
    providers_of,
)
from kiln.runtime.monitor import LoadMonitor, Observation
from kiln.runtime.ort_args import backend_of, check_run_options, session_overrides
from kiln.runtime.padding import (
    Verdict,
    batch_dims,
    check_padding,
    close,
    dims_of,
    input_layout,
    pad_feeds,
    slice_outputs,
    symbolic_dims,
)
from kiln.runtime.rebuild import Hooks, Rebuilder
from kiln.runtime.source import engine_options, open_source, run_precision
from kiln.runtime.steady import freeze_gc, release_gc, warm_up

Feeds = dict[str, np.ndarray]
# Request signatures whose verdict is kept; beyond this the cache starts afresh (a stream of
# ever-new shapes costs a check each, never unbounded memory).
MAX_SIGNATURES = 1024


@dataclass(frozen=True)
class _Checked:
    """What the checks of one request signature concluded."""

    dims: dict[str, int]  # every symbolic dim's value (never mutated: observations share it)
    elements: int  # input elements the request brings


class LocalSession:
    """Runs an artifact (NAME.kiln, with the backend settings in its manifest), a plain .onnx
    file or zoo:NAME (as-is, on ONNX Runtime unless `backend="openvino"` is given); see the
    module docstring for buckets.

    As onnxruntime.InferenceSession: `providers` picks the engine (CPUExecutionProvider: ONNX
    Runtime, OpenVINOExecutionProvider: OpenVINO); `sess_options`, an
    onnxruntime.SessionOptions, maps the fields set on it (threads, optimization level,
    execution mode, memory arena and pattern) onto the engine's options; `provider_options`
    is refused (pass `options`).

    `buckets`: "batch=1,4,8 seq=32,64" or a dict (default: the artifact's, else none);
    `warmup`: compile and run every bucket now rather than on first use; `adaptive`: rebuild
    the buckets in the background when the traffic changes; `share_weights`: ORT bucket
    executables share one copy of the weights; `options`: backend options overriding the
    recorded ones (unknown keys are refused, naming the backend's options); `keep_requests`:
    how many recent requests to keep for replay (`recent_requests`), e.g. by the feedback loop
    that A/B-measures a new configuration on real traffic before `reconfigure` adopts it;
    `steady`: once open (and warmed), run the model once at its largest bucket's shape so the
    engine's arena is sized before the first request, and hold the process's gc.freeze until
    `close` (see steady.py).
    """

    def __init__(
        self,
        path_or_model: str | Path,
        sess_options: Any = None,
        providers: list[Any] | None = None,
        provider_options: list[dict[str, Any]] | None = None,
        *,
        backend: str | None = None,
        buckets: dict[str, list[int]] | str | None = None,
        warmup: bool = False,
        adaptive: bool = False,
        share_weights: bool = True,
        options: dict[str, Any] | None = None,
        keep_requests: int = 0,
        steady: bool = True,
    ) -> None:
        where = str(path_or_model)
        if provider_options and any(provider_options):
            raise KilnError(
                f"{where}: provider_options are not taken; Kiln sets the engine's options "
                "itself: pass options={...} (see Session.options)."
            )
        backend = backend_of(providers, backend, where)
        source = open_source(path_or_model, backend)
        self._opened = (path_or_model, backend, share_weights)
        self._source = source
        self._where = source.where
        self.artifact = source.artifact
        self._backend = get_backend(source.backend)
        overrides = session_overrides(sess_options, source.backend, where)
        if overrides and isinstance(options, dict | None):
            options = {**overrides, **(options or {})}  # Kiln's own options win
        self._options = engine_options(source, options)
        self.precision = run_precision(source, self._options)
        # Bucket executables share one copy of the weights (ORT copies them per session);
        # the dynamic one keeps the recorded settings.
        self._share = source.backend == "ort" and share_weights
        self.executable = self._compile({})
        self._dynamic = self.executable
        self.max_executables = executable_cap(source.interface, self._share)
        self._layout = input_layout(source.interface)
        self._batch = batch_dims(self._layout)
        self.limits = dim_limits(source.interface, self._layout)
        self._signatures: dict[tuple, _Checked] = {}
        self._all_outputs = list(self.executable.output_names)
        self.monitor = LoadMonitor()
        self.keep_requests = keep_requests
        self._recent: deque[Feeds] | None = deque(maxlen=keep_requests) if keep_requests else None
        # What earlier sessions of this very file learnt: padding verdicts, last bucket set.
        self._record = records.record_path(source.model_path, source.backend)
        record = records.load_record(self._record)
        verdicts = records.recorded_verdicts(record)
        if verdicts is None:  # a record from another Kiln version: start afresh
            record, verdicts = {}, {}
        self._verdicts = verdicts
        self._verdict_lock = threading.Lock()
        hooks = Hooks(
            current=lambda: self._state,
            install=self._install,
            build=lambda state: self._build(state, verify=True),
            verdict=self.verdict,
            dynamic_dims=symbolic_dims(self._layout),
            learnt=self._save_record,
        )
        self._rebuilder = Rebuilder(self._where, hooks, self.monitor, AdaptivePolicy(), adaptive)
        resume = record.get("buckets") if adaptive else None
        self._state = BucketSet(self._start_buckets(buckets, resume))
        if warmup:
            self._build(self._state)
        self._frozen = steady and self._steady()
        # A loop tuning this session, attached by kiln.Session(feedback=True); close stops it.
        self.feedback: Any = None
        if adaptive:
            self._rebuilder.start()

    def _steady(self) -> bool:
        """The warm-up run and the GC freeze (steady.py). A model the warm-up cannot run still
        opens: its requests say what is wrong with theirs."""
        names = self.output_names
        try:
            warm_up(self.interface, self._state.buckets, lambda f: self._dynamic.run(f, names))
        except Exception as exc:  # synthesized inputs the model refuses: not the user's error
            self.monitor.decide("warm-up at open", f"skipped: {exc}")
        freeze_gc()
        return True

    def _start_buckets(self, given: dict[str, list[int]] | str | None, resume: Any) -> bk.Buckets:
        """The buckets asked for, else the artifact's, else `resume`: the last set an earlier
        session of this model swapped in (adaptive sessions only)."""
        given = given if given is not None else self._source.buckets or None
        if given is None and resume:
            try:
                resumed = self._checked_buckets(resume)
            except (KilnError, TypeError, AttributeError):
                resumed = {}  # a record from another Kiln version: start without
            if resumed:
                text = f"recorded buckets {bk.format_buckets(resumed)}"
                self.monitor.decide("session start", text)
                return resumed
        return self._checked_buckets(given)

    # ------------------------------------------------------------------ interface

    @property
    def interface(self) -> ir.Model:
        """The model's graph interface (inputs, outputs, metadata); weights are not needed
        from it and may not be loaded."""
        return self._source.interface

    @property
    def input_names(self) -> list[str]:
        return self.executable.input_names

    @property
    def output_names(self) -> list[str]:
        return self.executable.output_names

    def get_inputs(self) -> list[NodeArg]:
        """As onnxruntime.InferenceSession.get_inputs(): name, type, shape per input."""
        return [node_arg(v) for v in graph_inputs(self.interface)]

    def get_outputs(self) -> list[NodeArg]:
        return [node_arg(v) for v in self.interface.graph.outputs]

    def get_providers(self) -> list[str]:
        """The engine's providers, e.g. ['CPUExecutionProvider'] or ['OpenVINO:CPU']."""
        return providers_of(self.executable, self._backend.name)

    def get_modelmeta(self) -> ModelMetadata:
        return model_metadata(self.interface)

    @property
    def inputs(self) -> list[dict[str, Any]]:
        """{name, datatype (KServe), shape (-1 dynamic)} per input, for server metadata; and
        for an input with a dim the model bounds, `max_shape` (Kiln's extension): each dim's
        largest size, -1 where there is no limit (see limits.py)."""
        out = []
        for value in graph_inputs(self.interface):
            meta = kserve_meta(value)
            axes = self._layout[value.name]
            if any(axis in self.limits for axis in axes):
                meta["max_shape"] = max_shape(axes, self.limits)
            out.append(meta)
        return out

    @property
    def outputs(self) -> list[dict[str, Any]]:
        return [kserve_meta(v) for v in self.interface.graph.outputs]

    @property
    def buckets(self) -> bk.Buckets:
        """The bucket set in use now."""
        return {d: list(s) for d, s in self._state.buckets.items()}

    @property
    def adaptive(self) -> bool:
        return self._rebuilder.adaptive

    @property
    def policy(self) -> AdaptivePolicy:
        """When an adaptive session rebuilds; its fields may be changed while it runs."""
        return self._rebuilder.policy

    # ------------------------------------------------------------------ running

    def run(
        self, output_names: list[str] | None, feeds: Feeds, run_options: Any = None
    ) -> list[np.ndarray]:
        """As onnxruntime.InferenceSession.run: the outputs named (None: all), in order;
        `run_options`, an onnxruntime.RunOptions, is accepted (see ort_args.py)."""
        names = self._all_outputs if output_names is None else self._outputs(output_names)
        if run_options is not None:
            check_run_options(run_options, self._where)
        feeds, checked = self._check(feeds, self._where)
        outputs = self._execute(names, feeds, checked.dims, 1, checked.elements)
        if self._recent is not None:  # only requests that ran: a refused one is not replayed
            self._recent.append(feeds)
        return outputs

    def run_batch(
        self, requests: list[Feeds], output_names: list[str] | None = None
    ) -> list[list[np.ndarray]]:
        """Run several requests as one where that is safe (see batching.py); each request's
        outputs, in order."""
        names = self._all_outputs if output_names is None else self._outputs(output_names)
        where = self._where
        pairs = [self._check(f, f"{where} request {i}") for i, f in enumerate(requests)]
        requests = [feeds for feeds, _ in pairs]
        shapes = [checked.dims for _, checked in pairs]
        plan = batching.Plan(self._layout, self._batch, self.verdict, self._state.buckets)
        outputs = batching.run_batch(requests, shapes, names, plan, self._execute)
        if self._recent is not None:
            self._recent.extend(requests)
        return outputs

    def check_feeds(self, feeds: Feeds) -> Feeds:
        """The feeds as `run` takes them, or the KilnError `run` would raise for them: an
        unknown or missing input, a wrong dtype or shape, a dim past the model's limit. A
        server refuses a request with it before queueing it."""
        return self._check(feeds, self._where)[0]

    def _outputs(self, output_names: Any) -> list[str]:
        return output_list(output_names, self._all_outputs, self._where)

    def _check(self, feeds: Any, where: str) -> tuple[Feeds, _Checked]:
        """The feeds (string inputs' text as objects) and their checks' verdict, computed
        once per signature: every input's name, dtype and shape."""
        try:
            signature = tuple([(name, a.dtype, a.shape) for name, a in feeds.items()])
            known = self._signatures.get(signature)
        except (AttributeError, TypeError):  # not a dict of arrays: the checks say what
            signature, known = None, None
        if known is not None:
            return feeds, known
        checked = checked_feeds(feeds, self.interface, where)
        dims = dims_of(checked, self._layout)
        check_limits(dims, self.limits, checked, self._layout, where)
        verdict = _Checked(dims, batching.elements(checked))
        # Kept only where the feeds needed no conversion: those run as given next time.
        if signature is not None and all(checked[n] is feeds[n] for n in checked):
            if len(self._signatures) >= MAX_SIGNATURES:
                self._signatures.clear()
            self._signatures[signature] = verdict
        return checked, verdict

    def _execute(
        self, names: list[str], feeds: Feeds, dims: dict[str, int], requests: int, real: int
    ) -> list[np.ndarray]:
        state = self._state  # one read: a concurrent swap cannot mix two bucket sets
        key = self._route(state, dims)
        runner = self._dynamic
        if key is not None:
            try:  # before the clock starts: a lazy compile is not the bucket's latency
                runner = self._runner(state, key)
            except KilnError as exc:
                key = self._broken(state, key, exc)
        start = time.perf_counter()
        outputs: list[np.ndarray] | None = None
        if key is not None:
            padded = pad_feeds(feeds, self._layout, dict(key), self._batch)
            try:
                outputs = runner.run(padded, names)
            except KilnError as exc:
                # Dynamic first: if the error is the user's (bad ids), it is raised here.
                outputs = self._dynamic.run(feeds, names)
                key = self._broken(state, key, exc)
        if key is None:
            if outputs is None:
                outputs = self._dynamic.run(feeds, names)
            # Unpadded: one request runs as it came (a merged batch counts its own).
            executed = real if requests == 1 else batching.elements(feeds)
        else:
            grown = {d: dims[d] for d, s in key if s > dims[d]}
            if grown:
                axes = {d: self.verdict(d).axes for d in grown}
                outputs = slice_outputs(outputs, names, axes, grown)
            executed = batching.elements(padded)
        seconds = time.perf_counter() - start
        self.monitor.record(Observation(dims, bk.key_text(key), seconds, real, executed), requests)
        return outputs

    def _route(self, state: BucketSet, dims: dict[str, int]) -> bk.BucketKey | None:
        if not state.buckets:
            return None
        paddable = {d: self.verdict(d).allowed for d in state.buckets}
        key = bk.route(dims, state.buckets, paddable)
        return None if key in state.broken else key

    def _broken(self, state: BucketSet, key: bk.BucketKey, exc: KilnError) -> None:
        """A bucket the model cannot compile or run (e.g. a sequence longer than its position
        table) must not fail requests the dynamic executable serves: it is dropped."""
        if key not in state.broken:
            state.broken.add(key)
            self.monitor.decide(f"bucket {bk.key_text(key)} failed: {exc}", "route to dynamic")
        return None

    def _runner(self, state: BucketSet, key: bk.BucketKey) -> Executable:
        def compile_key(k: bk.BucketKey) -> Executable:
            return self._compile(dict(k))

        return state.runner(key, compile_key, self.max_executables, self.monitor)

    def verdict(self, dim: str) -> Verdict:
        """Whether padding `dim` is safe: checked numerically once per session and dim."""
        verdict = self._verdicts.get(dim)
        if verdict is None:
            with self._verdict_lock:
                verdict = self._verdicts.get(dim)
                if verdict is None:
                    verdict = self._check_padding(dim)
                    self._verdicts[dim] = verdict
                    self._save_record()
        return verdict

    def _check_padding(self, dim: str) -> Verdict:
        names = self.output_names
        verdict = check_padding(
            self.interface,
            self._layout,
            dim,
            lambda feeds: self._dynamic.run(feeds, names),
            names,
            self.precision,
        )
        action = "pad" if verdict.allowed else "never pad"
        self.monitor.decide(f"padding check '{dim}'", f"{action}: {verdict.reason}")
        return verdict

    # ------------------------------------------------------------------ building and swapping

    def _compile(
        self, dim_overrides: dict[str, int], options: dict[str, Any] | None = None
    ) -> Executable:
        settings = dict(options or self._options)
        if dim_overrides:  # a bucket; {} keeps the artifact's own (a tuned static shape)
            settings["dim_overrides"] = dim_overrides
        if dim_overrides and self._backend.name == "ort":
            settings["share_weights"] = self._share
            # Each ORT session has its own thread pool; spinning pools of idle buckets steal
            # the cores from the one running (BERT-base 4x128 on 2 cores: 13% slower).
            settings["spinning"] = False
        executable = self._backend.compile(
            self._source.model_path, options_from_json(self._backend.name, settings)
        )
        join_company(executable)  # a spinning ORT pool elsewhere in the process must stop
        return executable

    def _checked_buckets(self, buckets: dict[str, list[int]] | str | None) -> bk.Buckets:
        parsed = bk.parse_buckets(buckets)
        dynamic = symbolic_dims(self._layout)
        for dim in parsed:
            if dim not in dynamic:
                raise KilnError(
                    f"{self._where}: buckets name dim '{dim}', which is not a dynamic dim of the "
                    f"model's inputs; its dynamic dims are {dynamic or 'none'}."
                )
        return parsed

    def _build(self, state: BucketSet, verify: bool = False) -> None:
        """Compile and warm every bucket of `state` (one run each, at the bucket's shape); with
        `verify`, check each against the dynamic executable within the precision's tolerance."""
        keys = bk.all_keys(state.buckets)
        if len(keys) > self.max_executables:
            self.monitor.decide(
                f"build of {len(keys)} buckets",
                f"only {self.max_executables} stay loaded (memory); the others rebuild on use",
            )
        names = self.output_names
        for key in keys:
            sample = synthesize(self.interface, dims=dict(key))
            got = self._runner(state, key).run(sample, names)
            if not verify:
                continue
            want = self._dynamic.run(sample, names)
            for name, g, w in zip(names, got, want, strict=True):
                if not close(w, g, self.precision):
                    raise KilnError(
                        f"bucket {bk.key_text(key)}: output '{name}' differs from the "
                        "dynamic executable's."
                    )

    def _install(self, state: BucketSet) -> None:
        self._state = state  # the swap: one reference assignment

    def swap(
        self,
        buckets: dict[str, list[int]] | str | None = None,
        *,
        wait: bool = False,
        max_bytes: int | None = None,
    ) -> None:
        """Compile `buckets` (None: the current set again, forced) in the background, verify it
        and swap it in atomically. `wait` blocks until done (for tests and scripts);
        `max_bytes` refuses a set whose largest bucket's inputs would take more (a server's
        bound: no request could fill it, and warming it could exhaust memory)."""
        target = self._checked_buckets(buckets) if buckets is not None else self.buckets
        if max_bytes is not None:
            largest = {dim: max(sizes) for dim, sizes in target.items()}
            size = input_bytes(self.interface, largest)
            if size > max_bytes:
                raise KilnError(
                    f"buckets {bk.format_buckets(target)}: the largest bucket's inputs take "
                    f"{size / 2**20:.1f} MiB, more than the {max_bytes / 2**20:.1f} MiB this "
                    "server accepts in one batch; give smaller sizes."
                )
        done = self._rebuilder.submit(target, Trigger(TriggerKind.MANUAL, "swap() called"))
        if wait:
            done.wait()

    def wait_for_swap(self, count: int = 1, timeout: float = 60.0) -> bool:
        """Block until this session has swapped bucket sets `count` times in all (swap() or
        adaptive); False if `timeout` seconds pass first. For tests and scripts."""
        return self.monitor.wait_until(lambda m: m.swaps >= count, timeout)

    @property
    def options(self) -> dict[str, Any]:
        """The engine options the session runs with now."""
        return dict(self._options)

    @property
    def batch_dims(self) -> list[str]:
        """The dims that are a batch of independent items (axis 0 only)."""
        return sorted(self._batch)

    def twin(
        self, options: dict[str, Any] | None = None, buckets: bk.Buckets | None = None
    ) -> LocalSession:
        """A new session on the same model with these engine options on top of the current
        ones, and these buckets (default: the current ones): to measure a configuration off
        the request path."""
        path, backend, share = self._opened
        return LocalSession(
            path,
            backend=backend,
            buckets=buckets or self.buckets or None,
            share_weights=share,
            options={**self._options, **(options or {})},
        )

    def recent_requests(self) -> list[Feeds]:
        """The last `keep_requests` requests (oldest first), for replay."""
        return list(self._recent or [])

    def reconfigure(self, options: dict[str, Any], reason: str = "reconfigure()") -> None:
        """Run with these engine options (overrides of the current ones) from now on. The new
        dynamic executable and every bucket's are built and warmed, and their outputs checked
        against the current ones, before one swap; requests in flight finish on the old ones.
        KilnError, and nothing changes, when the new ones cannot build or disagree."""
        merged = engine_options(self._source, {**self._options, **options})
        precision = run_precision(self._source, merged)
        dynamic = self._compile({}, merged)
        names = self.output_names
        samples = self.recent_requests()[-1:] or [synthesize(self.interface)]
        for sample in samples:
            for name, want, got in zip(
                names, self._dynamic.run(sample, names), dynamic.run(sample, names), strict=True
            ):
                if not close(want, got, precision):
                    raise KilnError(
                        f"{self._where}: with options {options} output '{name}' differs from "
                        "the current configuration's; not adopted."
                    )
        state = BucketSet(self.buckets)
        for key in bk.all_keys(state.buckets)[: self.max_executables]:
            runner = state.runner(
                key, lambda k: self._compile(dict(k), merged),
                self.max_executables, self.monitor,
            )  # fmt: skip
            runner.run(synthesize(self.interface, dims=dict(key)), names)
        # The swap: a request reads the dynamic runner and the bucket set once each.
        self._options, self.precision = merged, precision
        self.executable, self._dynamic, self._state = dynamic, dynamic, state
        self.monitor.decide(reason, f"engine options now {options}")
        self.monitor.swapped()

    def _save_record(self) -> None:
        padding = records.verdicts_json(self._verdicts)
        records.save_record(self._record, {"buckets": self.buckets, "padding": padding})

    def stats(self) -> dict[str, Any]:
        """Per-bucket counts, padding waste and latency; hits, misses, recompiles, swaps, and
        every decision taken ({time, trigger, action})."""
        out = self.monitor.snapshot()
        out["bucket_set"] = self.buckets
        out["executables_loaded"] = len(self._state.runners)
        out["max_executables"] = self.max_executables
        out["padding"] = {
            d: {"allowed": v.allowed, "reason": v.reason} for d, v in self._verdicts.items()
        }
        return out

    def close(self) -> None:
        """Stop the background worker (a build in progress finishes first); give back the GC
        freeze a steady session holds; its executables are no one's company any more (see
        kiln.backends.spin_policy)."""
        if self.feedback is not None:
            self.feedback.stop()
        self._rebuilder.close()
        state = self._state
        with state.lock:
            runners = list(state.runners.values())
        for executable in [self.executable, *runners]:
            leave_company(executable)
        if self._frozen:
            self._frozen = False
            release_gc()

    def __enter__(self) -> LocalSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
