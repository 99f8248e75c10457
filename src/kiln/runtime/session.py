"""`kiln.Session(path).run(output_names, feeds)`, like an ONNX Runtime InferenceSession, with
shape buckets, a load monitor, background recompilation and hot swap.

A request's shape is routed to the smallest bucket holding it, padded up (where padding was
checked safe, see padding.py), run on a shape-specialised executable and its outputs sliced
back. Shapes no bucket holds run on the dynamic executable and count as misses. A swap builds a
whole new bucket set off the request path, verifies it, and replaces the old one with a single
reference assignment: a request reads `self._state` once, so it runs on one consistent set
and requests in flight finish on the old executables.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from kiln.artifact import read_artifact
from kiln.backends import Executable, default_options, get_backend, options_from_json
from kiln.errors import KilnError
from kiln.ir.inputs import check_feeds, synthesize
from kiln.runtime import buckets as bk
from kiln.runtime.adaptive import AdaptivePolicy, find_trigger
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
from kiln.runtime.records import kiln_home, load_record, record_path, save_record

log = logging.getLogger("kiln.runtime")

# ONNX element types under their KServe v2 (Open Inference Protocol) names.
KSERVE_TYPES = {
    "FLOAT": "FP32", "FLOAT16": "FP16", "DOUBLE": "FP64", "BFLOAT16": "BF16", "BOOL": "BOOL",
    "STRING": "BYTES", "INT8": "INT8", "INT16": "INT16", "INT32": "INT32", "INT64": "INT64",
    "UINT8": "UINT8", "UINT16": "UINT16", "UINT32": "UINT32", "UINT64": "UINT64",
}  # fmt: skip


class _Runner:
    """An executable plus, for engines whose executables are not thread-safe (OpenVINO keeps
    one infer request), a lock serialising its calls."""

    def __init__(self, executable: Executable, serialise: bool) -> None:
        self.executable = executable
        self._lock = threading.Lock() if serialise else None

    def run(self, feeds: dict[str, np.ndarray], names: list[str]) -> list[np.ndarray]:
        if self._lock is None:
            return self.executable.run(feeds, names)
        with self._lock:
            return self.executable.run(feeds, names)


@dataclass
class _BucketSet:
    """One bucket set and its executables, replaced as a whole by a swap."""

    buckets: bk.Buckets
    # Least recently used first: the order in which executables are dropped.
    runners: OrderedDict[bk.BucketKey, _Runner] = field(default_factory=OrderedDict)
    broken: set[bk.BucketKey] = field(default_factory=set)  # failed to compile or run
    lock: threading.Lock = field(default_factory=threading.Lock)  # guards `runners`
    compile_lock: threading.Lock = field(default_factory=threading.Lock)  # one compile at once


class Session:
    """Runs an artifact (NAME.kiln, with the backend settings in its manifest), a plain .onnx
    file or zoo:NAME (as-is, on ONNX Runtime unless `backend="openvino"` is given); see the
    module docstring for buckets. Other keyword arguments override backend options."""

    def __init__(
        self,
        path_or_model: str | Path,
        *,
        buckets: dict[str, list[int]] | str | None = None,
        warmup: bool = False,
        adaptive: bool = False,
        **option_overrides: Any,
    ) -> None:
        source = str(path_or_model)
        share_weights = bool(option_overrides.pop("share_weights", True))
        backend_name = option_overrides.pop("backend", None)
        self.artifact = None
        if Path(source).is_dir() or source.endswith(".kiln"):
            self.artifact = read_artifact(source)
            built_for = self.artifact.manifest["backend"]["name"]
            if backend_name not in (None, built_for):
                raise KilnError(
                    f"{source}: built for backend '{built_for}', it cannot run on "
                    f"'{backend_name}'. Build another artifact with --backend {backend_name}."
                )
            backend_name = built_for
            options = dict(self.artifact.manifest["backend"]["options"])
            self._model_path = str(self.artifact.model_path)
            # Only the graph's interface is needed for checks; weights stay on disk.
            self._interface = ir.load(self._model_path)
            if buckets is None and isinstance(self.artifact.manifest.get("buckets"), dict):
                buckets = self.artifact.manifest["buckets"] or None
        else:
            from kiln.ir.load import load_model

            loaded = load_model(source)
            # As-is on ONNX Runtime unless asked otherwise; fp32 on every engine.
            backend_name = backend_name or "ort"
            options = default_options(backend_name).to_json()
            self._interface = loaded.model
            self._model_path = source if not source.startswith("zoo:") else _on_disk(loaded)
        self._where = source
        self._backend = get_backend(backend_name)
        self._options = {**options_from_json(backend_name, options).to_json(), **option_overrides}
        try:
            options_from_json(backend_name, self._options)
        except TypeError:
            known = sorted(options_from_json(backend_name, options).to_json())
            raise KilnError(
                f"unknown option among {sorted(option_overrides)} for backend '{backend_name}'; "
                f"its options are {known}."
            ) from None
        if backend_name == "openvino" and not self._options.get("cache_dir"):
            # OpenVINO keys its cache by model and shape: one directory serves every bucket.
            # OPTIMIZE_SIZE keeps the weights out of the cache (1 MB per bucket of BERT-base
            # instead of 440 MB); they are read from the model file.
            self._options["cache_dir"] = str(kiln_home() / "openvino-cache")
            self._options["extra"] = {"CACHE_MODE": "OPTIMIZE_SIZE", **self._options["extra"]}
        self._serialise = backend_name == "openvino"
        # The tolerance of padding checks and swap verification follows the precision run.
        plan = self.artifact.manifest.get("precision") if self.artifact else None
        self.precision = str(plan.get("default", "fp32")) if isinstance(plan, dict) else "fp32"
        if backend_name == "openvino" and self._options.get("inference_precision") != "f32":
            self.precision = "bf16"  # OpenVINO's own choice on CPUs that have bf16
        # Bucket executables share one copy of the weights (ORT copies them per session);
        # the dynamic one keeps the recorded settings. `share_weights=False` opts out.
        self._share = backend_name == "ort" and share_weights
        self.executable = self._compile({})
        self.max_executables = _executable_cap(self._interface, self._share)
        self._dynamic = _Runner(self.executable, self._serialise)
        self._layout = input_layout(self._interface)
        self._batch = batch_dims(self._layout)
        # What earlier sessions of this very file learnt: padding verdicts, last bucket set.
        self._record = record_path(self._model_path, backend_name)
        record = load_record(self._record)
        self._verdicts: dict[str, Verdict] = {}
        try:
            self._verdicts = {d: Verdict(d, **v) for d, v in record.get("padding", {}).items()}
        except (TypeError, AttributeError):  # a record from another Kiln version: check again
            record = {}
        self._verdict_lock = threading.Lock()
        self._swap_lock = threading.Lock()  # one build-and-swap at a time
        self._worker_lock = threading.Lock()
        self._last_adapt = 0.0  # time.monotonic() of the last adaptive decision
        self.monitor = LoadMonitor()
        self.policy = AdaptivePolicy()
        self.adaptive = adaptive
        if buckets is None and adaptive and record.get("buckets"):
            try:
                buckets = self._checked_buckets(record["buckets"])
                self.monitor.decide(
                    "session start", f"recorded buckets {bk.format_buckets(buckets)}"
                )
            except (KilnError, TypeError, AttributeError):
                buckets = None  # a record from another Kiln version: start without
        self._state = _BucketSet(self._checked_buckets(buckets))
        self._baseline: dict[str, float] = {}  # bucket -> P99 seconds after the last swap
        self._jobs: queue.Queue = queue.Queue()
        self._worker: threading.Thread | None = None
        self._closed = False
        if warmup:
            self._build(self._state)
        if adaptive:
            self._start_worker()

    # ------------------------------------------------------------------ interface

    @property
    def input_names(self) -> list[str]:
        return self.executable.input_names

    @property
    def output_names(self) -> list[str]:
        return self.executable.output_names

    @property
    def inputs(self) -> list[dict[str, Any]]:
        """{name, datatype (KServe), shape (-1 dynamic)} per input, for server metadata."""
        graph = self._interface.graph
        return [_meta(v) for v in graph.inputs if v.name not in graph.initializers]

    @property
    def outputs(self) -> list[dict[str, Any]]:
        return [_meta(v) for v in self._interface.graph.outputs]

    @property
    def buckets(self) -> bk.Buckets:
        """The bucket set in use now."""
        return {d: list(s) for d, s in self._state.buckets.items()}

    # ------------------------------------------------------------------ running

    def run(self, output_names: list[str] | None, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        check_feeds(self._interface, feeds, where=self._where)
        names = self._output_list(output_names)
        return self._execute(names, feeds, dims_of(feeds, self._layout), 1, _elements(feeds))

    def run_batch(
        self, requests: list[dict[str, np.ndarray]], output_names: list[str] | None = None
    ) -> list[list[np.ndarray]]:
        """Run several requests as one: each is padded to the group's common size on the
        non-batch dims (where that is safe, else only equal shapes are grouped), they are
        concatenated along the batch dim, run, and the outputs split back per request."""
        names = self._output_list(output_names)
        for i, feeds in enumerate(requests):
            check_feeds(self._interface, feeds, where=f"{self._where} request {i}")
        shapes = [dims_of(f, self._layout) for f in requests]
        batch = self._concat_dim(names)
        results: list[list[np.ndarray] | None] = [None] * len(requests)
        if batch is None:
            for i, feeds in enumerate(requests):
                results[i] = self._execute(names, feeds, shapes[i], 1, _elements(feeds))
            return results  # type: ignore[return-value]
        paddable = {
            d for d in symbolic_dims(self._layout) if d != batch and self.verdict(d).allowed
        }
        groups: dict[tuple, list[int]] = {}
        for i, dims in enumerate(shapes):
            fixed = tuple(
                (d, v) for d, v in sorted(dims.items()) if d != batch and d not in paddable
            )
            groups.setdefault(fixed, []).append(i)
        for members in groups.values():
            for chunk in self._chunks(members, shapes, batch):
                self._run_group(chunk, requests, shapes, names, batch, paddable, results)
        return results  # type: ignore[return-value]

    def _run_group(
        self,
        chunk: list[int],
        requests: list[dict[str, np.ndarray]],
        shapes: list[dict[str, int]],
        names: list[str],
        batch: str,
        paddable: set[str],
        results: list,
    ) -> None:
        common = {d: max(shapes[i][d] for i in chunk) for d in paddable if d in shapes[chunk[0]]}
        padded = [pad_feeds(requests[i], self._layout, common, self._batch) for i in chunk]
        feeds = {n: np.concatenate([p[n] for p in padded], axis=0) for n in padded[0]}
        dims = {**shapes[chunk[0]], **common, batch: sum(shapes[i][batch] for i in chunk)}
        real = sum(_elements(requests[i]) for i in chunk)
        outputs = self._execute(names, feeds, dims, len(chunk), real)
        start = 0
        axes = {d: self.verdict(d).axes for d in [batch, *common]}
        for i in chunk:
            rows = slice(start, start + shapes[i][batch])
            start = rows.stop
            own = [o[rows] for o in outputs]  # _concat_dim checked: batch is axis 0
            results[i] = slice_outputs(own, names, axes, {d: shapes[i][d] for d in common})

    def _chunks(
        self, members: list[int], shapes: list[dict[str, int]], batch: str
    ) -> list[list[int]]:
        """Split so that each chunk's total batch fits the largest batch bucket (if any)."""
        sizes = self._state.buckets.get(batch)
        if not sizes:
            return [members]
        chunks: list[list[int]] = [[]]
        total = 0
        for i in members:
            rows = shapes[i][batch]
            if chunks[-1] and total + rows > sizes[-1]:
                chunks.append([])
                total = 0
            chunks[-1].append(i)
            total += rows
        return chunks

    def _concat_dim(self, names: list[str]) -> str | None:
        """The batch dim requests can be concatenated along: axis 0 of every input, padding it
        checked safe (rows independent), and axis 0 (only) of every output asked for."""
        firsts = {dims[0] if dims else None for dims in self._layout.values()}
        if len(firsts) != 1:
            return None
        batch = firsts.pop()
        if not isinstance(batch, str) or batch not in self._batch:
            return None
        verdict = self.verdict(batch)
        if not verdict.allowed or any(verdict.axes.get(n) != [0] for n in names):
            return None
        return batch

    def _execute(
        self,
        names: list[str],
        feeds: dict[str, np.ndarray],
        dims: dict[str, int],
        requests: int,
        real: int,
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
            executed = _elements(feeds)
        else:
            grown = {d: dims[d] for d, s in key if s > dims[d]}
            if grown:
                axes = {d: self.verdict(d).axes for d in grown}
                outputs = slice_outputs(outputs, names, axes, grown)
            executed = _elements(padded)
        seconds = time.perf_counter() - start
        self.monitor.record(Observation(dims, bk.key_text(key), seconds, real, executed), requests)
        return outputs

    def _route(self, state: _BucketSet, dims: dict[str, int]) -> bk.BucketKey | None:
        if not state.buckets:
            return None
        paddable = {d: self.verdict(d).allowed for d in state.buckets}
        key = bk.route(dims, state.buckets, paddable)
        return None if key in state.broken else key

    def _broken(self, state: _BucketSet, key: bk.BucketKey, exc: KilnError) -> None:
        """A bucket the model cannot compile or run (e.g. a sequence longer than its position
        table) must not fail requests the dynamic executable serves: it is dropped."""
        if key not in state.broken:
            state.broken.add(key)
            self.monitor.decide(f"bucket {bk.key_text(key)} failed: {exc}", "route to dynamic")
        return None

    def _runner(self, state: _BucketSet, key: bk.BucketKey) -> _Runner:
        """The bucket's executable; the first request of a bucket compiles it, once. Beyond
        `max_executables` the least recently used one is dropped (requests running on it
        finish; it is rebuilt if needed again)."""
        with state.lock:
            runner = state.runners.get(key)
            if runner is not None:
                state.runners.move_to_end(key)
                return runner
        # A separate lock: requests for buckets already built go on during a compile.
        with state.compile_lock:
            runner = state.runners.get(key)
            if runner is None:
                runner = _Runner(self._compile(dict(key)), self._serialise)
                self.monitor.compiles += 1
                with state.lock:
                    state.runners[key] = runner
                    while len(state.runners) > self.max_executables:
                        state.runners.popitem(last=False)
                        self.monitor.evictions += 1
        return runner

    def _output_list(self, output_names: list[str] | None) -> list[str]:
        unknown = set(output_names or []) - set(self.output_names)
        if unknown:
            raise KilnError(
                f"unknown output '{sorted(unknown)[0]}'; the model's outputs are "
                f"{self.output_names}."
            )
        return list(output_names) if output_names else list(self.output_names)

    def verdict(self, dim: str) -> Verdict:
        """Whether padding `dim` is safe: checked numerically once per session and dim."""
        verdict = self._verdicts.get(dim)
        if verdict is None:
            with self._verdict_lock:
                verdict = self._verdicts.get(dim)
                if verdict is None:
                    verdict = check_padding(
                        self._interface,
                        self._layout,
                        dim,
                        lambda feeds: self._dynamic.run(feeds, self.output_names),
                        self.output_names,
                        self.precision,
                    )
                    action = "pad" if verdict.allowed else "never pad"
                    self.monitor.decide(f"padding check '{dim}'", f"{action}: {verdict.reason}")
                    self._verdicts[dim] = verdict
                    self._save_record()
        return verdict

    # ------------------------------------------------------------------ building and swapping

    def _compile(self, dim_overrides: dict[str, int]) -> Executable:
        settings = {**self._options, "dim_overrides": dim_overrides}
        if dim_overrides and self._backend.name == "ort":
            settings["share_weights"] = self._share
            # Each ORT session has its own thread pool; spinning pools of idle buckets steal
            # the cores from the one running (BERT-base 4x128 on 2 cores: 13% slower).
            settings["spinning"] = False
        return self._backend.compile(
            self._model_path, options_from_json(self._backend.name, settings)
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

    def _build(self, state: _BucketSet, verify: bool = False) -> None:
        """Compile and warm every bucket of `state` (one run each, at the bucket's shape); with
        `verify`, check each against the dynamic executable within fp32 tolerance."""
        keys = bk.all_keys(state.buckets)
        if len(keys) > self.max_executables:
            self.monitor.decide(
                f"build of {len(keys)} buckets",
                f"only {self.max_executables} stay loaded (memory); the others rebuild on use",
            )
        for key in keys:
            runner = self._runner(state, key)
            sample = synthesize(self._interface, dims=dict(key))
            got = runner.run(sample, self.output_names)
            if verify:
                want = self._dynamic.run(sample, self.output_names)
                for name, g, w in zip(self.output_names, got, want, strict=True):
                    if not close(w, g, self.precision):
                        raise KilnError(
                            f"bucket {bk.key_text(key)}: output '{name}' differs from the "
                            "dynamic executable's."
                        )

    def swap(
        self, buckets: dict[str, list[int]] | str | None = None, *, wait: bool = False
    ) -> None:
        """Compile `buckets` (None: the current set again, forced) in the background, verify it
        and swap it in atomically. `wait` blocks until done (for tests and scripts)."""
        target = self._checked_buckets(buckets) if buckets is not None else self.buckets
        done = threading.Event()
        self._start_worker((target, "swap() called", done))
        if wait:
            done.wait()

    def _rebuild(self, buckets: bk.Buckets, trigger: str) -> bool:
        """Build, warm and verify a new bucket set, then swap it in. Runs on the worker."""
        with self._swap_lock:
            self.monitor.recompiles += 1
            new = _BucketSet(buckets)
            try:
                for dim in buckets:
                    self.verdict(dim)
                self._build(new, verify=True)
            except KilnError as exc:
                self.monitor.decide(trigger, f"kept {bk.format_buckets(self.buckets)}: {exc}")
                return False
            old = bk.format_buckets(self._state.buckets)
            self._state = new  # the swap: one reference assignment
            self.monitor.swaps += 1
            self.monitor.reset_window()
            self._baseline = {}
            self.monitor.decide(trigger, f"swapped {old} -> {bk.format_buckets(buckets)}")
            self._save_record()
            return True

    def _save_record(self) -> None:
        verdicts = {d: asdict(v) for d, v in self._verdicts.items()}
        for v in verdicts.values():
            del v["dim"]
        save_record(self._record, {"buckets": self.buckets, "padding": verdicts})

    def _start_worker(self, job: tuple | None = None) -> None:
        """Start the worker if needed and queue `job`; under the lock close() takes, so that
        no job lands behind close()'s stop signal and waits forever."""
        with self._worker_lock:
            if self._closed:
                raise KilnError(f"{self._where}: the session is closed; open a new one.")
            if self._worker is None:
                # One daemon thread does all background builds, one bucket after another:
                # the request path never compiles for a swap, and builds never pile up.
                self._worker = threading.Thread(target=self._work, name="kiln-rebuild", daemon=True)
                self._worker.start()
            if job is not None:
                self._jobs.put(job)

    def _work(self) -> None:
        last_check = time.monotonic()
        while True:
            try:
                job = self._jobs.get(timeout=self.policy.interval_s)
            except queue.Empty:
                job = False
            if job is None:
                return
            # The worker must survive anything a build throws (an engine error, no memory).
            if job:
                buckets, trigger, done = job
                try:
                    self._rebuild(buckets, trigger)
                except Exception as exc:
                    self.monitor.decide(trigger, f"build failed: {exc}")
                finally:
                    done.set()
            if self.adaptive and time.monotonic() - last_check >= self.policy.interval_s:
                last_check = time.monotonic()
                try:
                    self._adapt()
                except Exception as exc:
                    self.monitor.decide("adaptive check", f"failed: {exc}")

    def _adapt(self) -> None:
        """Judge the traffic since the last swap; rebuild when a trigger fires and a better
        bucket set exists (or, on P99 drift, rebuild the same set afresh)."""
        policy, window = self.policy, self.monitor.window()
        if len(window) < policy.min_samples:
            return
        if self._last_adapt and time.monotonic() - self._last_adapt < policy.cooldown_s:
            return
        trigger = find_trigger(window, policy, self._baseline)
        if trigger is None:
            return
        self._last_adapt = time.monotonic()
        current = self._state.buckets
        dims = list(current) or symbolic_dims(self._layout)
        paddable = {d: self.verdict(d).allowed for d in dims}
        per_dim = max(policy.sizes_per_dim, *(len(s) for s in current.values()), 1)
        proposal = bk.propose([o.dims for o in window], dims, paddable, per_dim)
        observed = [o.dims for o in window]
        better = bk.score(observed, proposal, paddable) < bk.score(observed, current, paddable)
        if better or trigger.startswith("P99"):
            self._rebuild(proposal if better else current, trigger)
        else:
            self.monitor.decide(trigger, f"kept {bk.format_buckets(current)}: nothing better")
            self.monitor.reset_window()

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
        with self._worker_lock:
            self._closed = True
            worker, self._worker = self._worker, None
            self._jobs.put(None)  # behind any queued job: those finish first
        if worker is not None:
            worker.join()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _on_disk(loaded: Any) -> str:
    """A zoo model written once under KILN_HOME (atomically: temp dir, then rename), so that
    each bucket compiles from a file instead of re-serialising the model."""
    target = kiln_home() / "models" / f"{loaded.name}-{loaded.fingerprint[:16]}"
    if not (target / "model.onnx").is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            ir.save(loaded.model, tmp / "model.onnx", external_data="model.onnx.data")
            tmp.rename(target)
        except OSError:
            if not (target / "model.onnx").is_file():  # lost no race: a real failure
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target / "model.onnx")


def _executable_cap(model: ir.Model, shared: bool) -> int:
    """How many bucket executables stay loaded: their estimated memory (a weight copy each,
    about 2x the weights for OpenVINO as measured on BERT-base; an eighth of that when the
    weights are shared) within a quarter of the machine's memory; between 2 and 32."""
    weights = sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value)
    each = max(weights // 8 if shared else weights * 2, 16 << 20)
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        memory = 8 << 30
    return max(2, min(32, memory // 4 // each))


def _elements(feeds: dict[str, np.ndarray]) -> int:
    return sum(int(np.size(a)) for a in feeds.values())


def _meta(value: ir.Value) -> dict[str, Any]:
    dtype = KSERVE_TYPES.get(value.dtype.name, value.dtype.name) if value.dtype else "BYTES"
    shape = [d if isinstance(d, int) and d >= 0 else -1 for d in (value.shape or [-1])]
    return {"name": value.name, "datatype": dtype, "shape": shape}
