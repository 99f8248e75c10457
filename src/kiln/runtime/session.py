"""`kiln.Session(path).run(output_names, feeds)`, like an ONNX Runtime InferenceSession, with
shape buckets, a load monitor, background recompilation and hot swap.

A request's shape is routed to the smallest bucket holding it, padded up (where padding was
checked safe, see padding.py), run on a shape-specialised executable and its outputs sliced
back. Shapes no bucket holds run on the dynamic executable and count as misses. A swap (see
rebuild.py) replaces the whole bucket set with one reference assignment: a request reads
`self._state` once, so it runs on one consistent set and requests in flight finish on the
old executables. Opening the source is source.py; merging requests is batching.py.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from kiln.backends import Executable, get_backend, options_from_json
from kiln.errors import KilnError
from kiln.ir.inputs import input_bytes, synthesize
from kiln.runtime import batching
from kiln.runtime import buckets as bk
from kiln.runtime.adaptive import AdaptivePolicy, Trigger, TriggerKind
from kiln.runtime.arguments import checked_feeds, output_list
from kiln.runtime.bucketset import BucketSet, Runner, executable_cap
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
from kiln.runtime.records import load_record, record_path, save_record
from kiln.runtime.source import engine_options, open_source, run_precision

Feeds = dict[str, np.ndarray]


class Session:
    """Runs an artifact (NAME.kiln, with the backend settings in its manifest), a plain .onnx
    file or zoo:NAME (as-is, on ONNX Runtime unless `backend="openvino"` is given); see the
    module docstring for buckets.

    `buckets`: "batch=1,4,8 seq=32,64" or a dict (default: the artifact's, else none);
    `warmup`: compile and run every bucket now rather than on first use; `adaptive`: rebuild
    the buckets in the background when the traffic changes; `share_weights`: ORT bucket
    executables share one copy of the weights; `options`: backend options overriding the
    recorded ones (unknown keys are refused, naming the backend's options); `keep_requests`:
    how many recent requests to keep for replay (`recent_requests`), e.g. by the feedback loop
    that A/B-measures a new configuration on real traffic before `reconfigure` adopts it.
    """

    def __init__(
        self,
        path_or_model: str | Path,
        *,
        backend: str | None = None,
        buckets: dict[str, list[int]] | str | None = None,
        warmup: bool = False,
        adaptive: bool = False,
        share_weights: bool = True,
        options: dict[str, Any] | None = None,
        keep_requests: int = 0,
    ) -> None:
        source = open_source(path_or_model, backend)
        self._opened = (path_or_model, backend, share_weights)
        self._source = source
        self._where = source.where
        self.artifact = source.artifact
        self._backend = get_backend(source.backend)
        self._options = engine_options(source, options)
        self.precision = run_precision(source, self._options)
        self._serialise = source.backend == "openvino"  # one infer request per executable
        # Bucket executables share one copy of the weights (ORT copies them per session);
        # the dynamic one keeps the recorded settings.
        self._share = source.backend == "ort" and share_weights
        self.executable = self._compile({})
        self._dynamic = Runner(self.executable, self._serialise)
        self.max_executables = executable_cap(source.interface, self._share)
        self._layout = input_layout(source.interface)
        self._batch = batch_dims(self._layout)
        self.monitor = LoadMonitor()
        self.keep_requests = keep_requests
        self._recent: deque[Feeds] | None = deque(maxlen=keep_requests) if keep_requests else None
        # What earlier sessions of this very file learnt: padding verdicts, last bucket set.
        self._record = record_path(source.model_path, source.backend)
        record = load_record(self._record)
        verdicts = _recorded_verdicts(record)
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
        if adaptive:
            self._rebuilder.start()

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
        """{name, datatype (KServe), shape (-1 dynamic)} per input, for server metadata."""
        return [kserve_meta(v) for v in graph_inputs(self.interface)]

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

    def run(self, output_names: list[str] | None, feeds: Feeds) -> list[np.ndarray]:
        """As onnxruntime.InferenceSession.run: the outputs named (None: all), in order."""
        names = output_list(output_names, self.output_names, self._where)
        feeds = checked_feeds(feeds, self.interface, self._where)
        if self._recent is not None:
            self._recent.append(feeds)
        dims = dims_of(feeds, self._layout)
        return self._execute(names, feeds, dims, 1, batching.elements(feeds))

    def run_batch(
        self, requests: list[Feeds], output_names: list[str] | None = None
    ) -> list[list[np.ndarray]]:
        """Run several requests as one where that is safe (see batching.py); each request's
        outputs, in order."""
        names = output_list(output_names, self.output_names, self._where)
        where = self._where
        requests = [
            checked_feeds(f, self.interface, f"{where} request {i}") for i, f in enumerate(requests)
        ]
        if self._recent is not None:
            self._recent.extend(requests)
        shapes = [dims_of(f, self._layout) for f in requests]
        plan = batching.Plan(self._layout, self._batch, self.verdict, self._state.buckets)
        return batching.run_batch(requests, shapes, names, plan, self._execute)

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
            executed = batching.elements(feeds)
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

    def _runner(self, state: BucketSet, key: bk.BucketKey) -> Runner:
        def compile_key(k: bk.BucketKey) -> Runner:
            return Runner(self._compile(dict(k)), self._serialise)

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
        settings = {**(options or self._options), "dim_overrides": dim_overrides}
        if dim_overrides and self._backend.name == "ort":
            settings["share_weights"] = self._share
            # Each ORT session has its own thread pool; spinning pools of idle buckets steal
            # the cores from the one running (BERT-base 4x128 on 2 cores: 13% slower).
            settings["spinning"] = False
        return self._backend.compile(
            self._source.model_path, options_from_json(self._backend.name, settings)
        )

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
    ) -> Session:
        """A new session on the same model with these engine options on top of the current
        ones, and these buckets (default: the current ones): to measure a configuration off
        the request path."""
        path, backend, share = self._opened
        return Session(
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
        dynamic = Runner(self._compile({}, merged), self._serialise)
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
                key, lambda k: Runner(self._compile(dict(k), merged), self._serialise),
                self.max_executables, self.monitor,
            )  # fmt: skip
            runner.run(synthesize(self.interface, dims=dict(key)), names)
        # The swap: a request reads the dynamic runner and the bucket set once each.
        self._options, self.precision = merged, precision
        self.executable, self._dynamic, self._state = dynamic.executable, dynamic, state
        self.monitor.decide(reason, f"engine options now {options}")
        self.monitor.swapped()

    def _save_record(self) -> None:
        verdicts = {d: asdict(v) for d, v in self._verdicts.items()}
        for v in verdicts.values():
            del v["dim"]
        save_record(self._record, {"buckets": self.buckets, "padding": verdicts})

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
        """Stop the background worker (a build in progress finishes first)."""
        self._rebuilder.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _recorded_verdicts(record: dict[str, Any]) -> dict[str, Verdict] | None:
    """The padding verdicts an earlier session recorded; None if the record is from another
    Kiln version (then it is ignored and everything is checked again)."""
    try:
        return {d: Verdict(d, **v) for d, v in record.get("padding", {}).items()}
    except (TypeError, AttributeError):
        return None
