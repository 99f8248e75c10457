"""ONNX Runtime CPU backend, with every session option that matters under Kiln's control."""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
import threading
import weakref
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from kiln.backends import spin_policy
from kiln.backends.base import KernelRecord, Profile, check_flags
from kiln.backends.cpus import allowed_cpus, pool_affinities
from kiln.backends.ort_mapped import mapped_weights, session_on_mapped
from kiln.errors import KilnError

log = logging.getLogger("kiln.backends")

LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}
# Serialized protobufs cannot exceed 2 GiB; above this, models go through a file with
# external data.
_INLINE_LIMIT = 1 << 30
# ONNX Runtime's own log lines (its "[E:onnxruntime:...]" on a failed load) never reach the
# user's terminal: every failure it has is raised, and Kiln says it once, as a KilnError.
MODES = {
    "sequential": ort.ExecutionMode.ORT_SEQUENTIAL,
    "parallel": ort.ExecutionMode.ORT_PARALLEL,
}
_FATAL_ONLY = 4
# ... nor do those of sessions Kiln does not open itself (the quantizers' calibration runs).
ort.set_default_logger_severity(_FATAL_ONLY)
# How the CPU arena grows when a request does not fit: by doubling its last region
# (ONNX Runtime's default) or by exactly what was asked (OrtArenaCfg's arena_extend_strategy).
ARENA_EXTEND = {"next_power_of_two": 0, "same_as_requested": 1}
STOP_SPINNING_BYTES = 4 * 2**20


@dataclass
class OrtOptions:
    """Session options. 0 threads means ONNX Runtime's own default."""

    optimization: str = "all"
    intra_op_threads: int = 0
    inter_op_threads: int = 0
    # "parallel" runs independent branches of the graph at once on the inter-op pool.
    execution_mode: str = "sequential"
    spinning: bool = True
    # session.force_spinning_stop: the pool spins during a run and stops when it ends, so an
    # idle model's pool steals no core from the rest of the process (a second model, a
    # server's event loop). Two fp32 artifacts alternating in one process (resnet50,
    # bert-base; 2-core EPYC): spinning on kept 0.52x / 0.78x of their speed alone, stopped
    # 0.87x / 0.99x. Alone, stopping costs the tail: resnet50's jitter 0.58-0.73 stopped vs
    # 0.28 spinning (AVX-512 EPYC, blocks of 100 runs interleaved). A sub-millisecond model
    # pays ~20 us per run to wake the pool (bert-tiny 0.16 -> 0.18 ms). None: Kiln decides —
    # the pool spins while it has the process to itself and stops once company arrives
    # (`kiln.backends.spin_policy`); a model under STOP_SPINNING_BYTES of weights keeps
    # spinning beside other small ones.
    stop_spinning: bool | None = None
    memory_arena: bool = True
    memory_pattern: bool = True
    extra: dict[str, str] = field(default_factory=dict)
    # Symbolic dim name -> fixed size: a shape-specialised session (one per shape bucket).
    dim_overrides: dict[str, int] = field(default_factory=dict)
    # Sessions of one model file share one copy of its weights (only when compiled from a
    # path). ORT copies weights per session (20 BERT-base bucket sessions took 7 GB); and
    # its weight prepacking makes a per-session copy too, so that is turned off with it.
    share_weights: bool = False
    # Memory decisions (defaults are ONNX Runtime's own). `prepacking` False sets
    # session.disable_prepacking: MatMul/Conv weights are not repacked into the kernels'
    # layout at load, so the session holds no packed copy beside them (slower GEMMs at batch
    # > 1). `arena_extend` "same_as_requested" grows the CPU arena by exactly what a request
    # needs instead of doubling; ONNX Runtime takes it only through an allocator registered
    # with its environment, so such sessions share one arena (see `_shared_arena`).
    prepacking: bool = True
    arena_extend: str = "next_power_of_two"
    # Steadiness decisions (off: ONNX Runtime's own behaviour). `flush_denormals` sets
    # session.set_denormal_as_zero: the intra-op pool's threads flush denormal floats to zero
    # (FTZ/DAZ), which some weights otherwise pay up to 30x for. ONNX Runtime sets it on its
    # pool threads only: the calling thread's share of each op keeps denormals, and the
    # process's other threads (numpy's) are untouched. `pin_threads` pins each pool thread to
    # a core (session.intra_op_thread_affinities, from the CPUs this process may use, physical
    # cores first): an explicit `intra_op_threads` turns ONNX Runtime's own pinning off, and
    # this puts it back; with 0 threads ONNX Runtime pins by itself and nothing is added.
    flush_denormals: bool = False
    pin_threads: bool = False
    # ONNX Runtime's own graph optimizers left out (InferenceSession's disabled_optimizers),
    # by name: Kiln leaves out "SkipLayerNormFusion" where the fused kernel measured slower
    # than its parts here (kiln.passes.fused_op_pays): given the shapes Kiln's graphs state,
    # ORT would fuse Add + LayerNormalization into it by itself.
    disabled_optimizers: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["disabled_optimizers"] = list(self.disabled_optimizers)
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> OrtOptions:
        data = dict(data)
        if "disabled_optimizers" in data:
            data["disabled_optimizers"] = tuple(data["disabled_optimizers"])
        return cls(**data)

    def session_options(self) -> ort.SessionOptions:
        if self.optimization not in LEVELS:
            raise KilnError(
                f"unknown ORT optimization level '{self.optimization}'; "
                f"use one of {', '.join(LEVELS)}."
            )
        if self.execution_mode not in MODES:
            raise KilnError(
                f"unknown ORT execution mode '{self.execution_mode}'; use one of "
                f"{', '.join(MODES)}."
            )
        if self.arena_extend not in ARENA_EXTEND:
            raise KilnError(
                f"unknown ORT arena_extend '{self.arena_extend}'; use one of "
                f"{', '.join(ARENA_EXTEND)}."
            )
        check_flags("ORT", self, ("flush_denormals", "pin_threads"), ("stop_spinning",))
        so = ort.SessionOptions()
        so.execution_mode = MODES[self.execution_mode]
        so.graph_optimization_level = LEVELS[self.optimization]
        so.intra_op_num_threads = self.intra_op_threads
        so.inter_op_num_threads = self.inter_op_threads
        so.enable_cpu_mem_arena = self.memory_arena
        so.enable_mem_pattern = self.memory_pattern
        so.log_severity_level = _FATAL_ONLY
        entries = {"session.intra_op.allow_spinning": "1" if self.spinning else "0"}
        if not self.prepacking:
            entries["session.disable_prepacking"] = "1"
        if self.flush_denormals:
            entries["session.set_denormal_as_zero"] = "1"
        affinities = self._affinities()
        if affinities:
            entries["session.intra_op_thread_affinities"] = affinities
        if self.memory_arena and self.arena_extend != "next_power_of_two":
            _shared_arena(self.arena_extend)
            entries["session.use_env_allocators"] = "1"
        for key, value in {**entries, **self.extra}.items():  # each once: ORT warns on repeats
            so.add_session_config_entry(key, value)
        for dim, size in self.dim_overrides.items():
            so.add_free_dimension_override_by_name(dim, int(size))
        return so

    def _affinities(self) -> str | None:
        """The pool's pinning, when `pin_threads` asks for it and there is a pool to pin."""
        if not self.pin_threads or self.intra_op_threads <= 1:
            return None  # ONNX Runtime pins its default pool itself; one thread has no pool
        affinities = pool_affinities(self.intra_op_threads)
        if affinities is None:
            log.warning(
                "kiln: ORT pin_threads: %d intra-op threads but this process may use only %d "
                "CPUs; the threads are left unpinned.",
                self.intra_op_threads,
                len(allowed_cpus()),
            )
        return affinities


_ARENAS: dict[str, str] = {}  # the one CPU allocator registered with ONNX Runtime's environment
_ARENA_LOCK = threading.Lock()


def _shared_arena(strategy: str) -> None:
    """Register, once per process, the CPU arena allocator with `strategy` in ONNX Runtime's
    environment; sessions opt in with session.use_env_allocators. The environment takes one
    CPU allocator for the life of the process, so one strategy other than the default can be
    had per process, and the sessions using it share one arena (what one frees, another
    reuses; it is not returned when they close)."""
    with _ARENA_LOCK:
        if "cpu" in _ARENAS:
            if _ARENAS["cpu"] != strategy:
                raise KilnError(
                    f"ORT arena_extend '{strategy}': this process already shares a CPU arena "
                    f"that extends '{_ARENAS['cpu']}'; ONNX Runtime keeps one per process."
                )
            return
        info = ort.OrtMemoryInfo(
            "Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT
        )
        config = ort.OrtArenaCfg({"arena_extend_strategy": ARENA_EXTEND[strategy]})
        ort.create_and_register_allocator(info, config)
        _ARENAS["cpu"] = strategy


class OrtExecutable:
    """An ONNX Runtime InferenceSession behind Kiln's Executable contract."""

    def __init__(
        self,
        session: ort.InferenceSession,
        options: OrtOptions,
        model: ir.Model | str,
        stopped: bool = False,
    ) -> None:
        self.session = session
        self.options = options
        self.stopped = stopped  # the pool stops spinning after each run
        self._model = model  # kept to open a profiling session on demand
        self.weights: _Weights | None = None
        self.input_names = [i.name for i in session.get_inputs()]
        self.output_names = [o.name for o in session.get_outputs()]
        self.providers = list(session.get_providers())

    def run(
        self, feeds: dict[str, np.ndarray], output_names: list[str] | None = None
    ) -> list[np.ndarray]:
        try:
            return self.session.run(output_names, feeds)
        except (ort.capi.onnxruntime_pybind11_state.InvalidArgument, ValueError) as exc:
            raise KilnError(f"invalid inputs: {_explain(exc)}") from None
        except Exception as exc:  # a kernel failing on these inputs (shape mismatch inside)
            raise KilnError(f"ONNX Runtime failed to run the model: {_explain(exc)}") from None

    def stop_spinning(self) -> None:
        """Reopen the session with its pool stopped after each run (another executable now
        shares the process). Both sessions are held while it reopens (once per executable);
        a run under way finishes on the session it started on."""
        if self.stopped:
            return
        so = _prepared(self.options.session_options(), self.options, self.weights, stopped=True)
        self.session = _open(self._model, so, self.options.disabled_optimizers)
        self.stopped = True

    def profile(self, feeds: dict[str, np.ndarray], runs: int) -> Profile:
        """Per-kernel records from ONNX Runtime's own profiler over `runs` runs after one
        warm-up, and each profiled run's own wall time (the profiler slows every kernel a
        little, so per-kernel sums are set against the runs they came from)."""
        with tempfile.TemporaryDirectory(prefix="kiln-profile-") as tmp:
            so = self.options.session_options()
            so.enable_profiling = True
            so.profile_file_prefix = str(Path(tmp) / "ort")
            session = _open(self._model, so, self.options.disabled_optimizers)
            session.run(None, feeds)
            for _ in range(runs):
                session.run(None, feeds)
            events = json.loads(Path(session.end_profiling()).read_text())
        run_ms = [e["dur"] / 1e3 for e in events if _is_run(e)][1:]  # the warm-up's dropped
        return Profile(_kernel_records(events), run_ms, engine="onnxruntime")


class OrtBackend:
    name = "ort"

    def available(self) -> bool:
        return True

    def describe(self) -> dict[str, str]:
        return {
            "engine": "onnxruntime",
            "version": ort.__version__,
            "providers": ",".join(ort.get_available_providers()),
        }

    def compile(self, model: ir.Model | str, options: OrtOptions | None = None) -> OrtExecutable:
        options = options or OrtOptions()
        so = options.session_options()
        weights = None
        if options.share_weights and isinstance(model, str | os.PathLike) and Path(model).is_file():
            weights = _shared_weights(str(model))
        policy = _spin_policy(model, options)
        # Under the lock, so that two executables opening at once each see the other.
        kilns_choice, small = policy in (SHARED, SMALL), policy == SMALL
        with spin_policy.LOCK:
            stopped = policy == STOP or (kilns_choice and spin_policy.crowded(small))
            so = _prepared(so, options, weights, stopped)
            session = _open(model, so, options.disabled_optimizers)
            executable = OrtExecutable(session, options, model, stopped=stopped)
            executable.weights = weights  # the shared copy lives as long as a session using it
            if kilns_choice:
                spin_policy.join(executable, spins=True, small=small)
        return executable


class _Weights:
    """A model file's large initializers as OrtValues, shared by sessions (add_initializer
    uses the buffer without copying it)."""

    def __init__(self, path: str) -> None:
        graph = ir.load(path).graph
        self.arrays = {}
        for name, value in graph.initializers.items():
            # Small ones (shapes, axes) stay in the model, where ORT can constant-fold them.
            if value.const_value is None or value.const_value.nbytes < 4096:
                continue
            array = np.ascontiguousarray(value.const_value.numpy())
            if array.dtype.kind in "biuf":  # bfloat16, float8, int4 have no plain numpy type
                self.arrays[name] = array
        self.values = {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in self.arrays.items()}


_SHARED: weakref.WeakValueDictionary[tuple[str, int], _Weights] = weakref.WeakValueDictionary()
_SHARED_LOCK = threading.Lock()


def _prepared(
    so: ort.SessionOptions, options: OrtOptions, weights: _Weights | None, stopped: bool
) -> ort.SessionOptions:
    """`so` with the shared weights handed over (the session must not prepack its own copy of
    them) and, if `stopped`, the pool stopped after each run: what opening and reopening add."""
    if weights is not None:
        if options.prepacking and "session.disable_prepacking" not in options.extra:
            so.add_session_config_entry("session.disable_prepacking", "1")
        for name, value in weights.values.items():
            so.add_initializer(name, value)
    if stopped:
        so.add_session_config_entry("session.force_spinning_stop", "1")
    return so


def _shared_weights(path: str) -> _Weights:
    file = Path(path).resolve()
    key = (str(file), file.stat().st_mtime_ns)  # a rewritten file is read again
    with _SHARED_LOCK:
        weights = _SHARED.get(key)
        if weights is None:
            weights = _Weights(str(file))
            _SHARED[key] = weights
    return weights


# SHARED and SMALL: Kiln's choice, a pool that spins until company arrives (SMALL: a model
# under STOP_SPINNING_BYTES, whose pool keeps spinning beside other small ones).
SPIN, STOP, SHARED, SMALL = "spin", "stop", "shared", "small"


def _spin_policy(model: ir.Model | str, options: OrtOptions) -> str:
    """SPIN or STOP as OrtOptions.stop_spinning says; when it is None, Kiln's choice by the
    weights' size (the model file and its external data as stored, or an in-memory model's
    initializers): SHARED from STOP_SPINNING_BYTES up, else SMALL."""
    if "session.force_spinning_stop" in options.extra or not options.spinning:
        return SPIN  # said explicitly, or nothing spins: no entry of Kiln's
    if options.stop_spinning is not None:
        return STOP if options.stop_spinning else SPIN
    if isinstance(model, str | os.PathLike):
        path = Path(model)
        stored = [path, *path.parent.glob(f"{path.name}.data")] if path.is_file() else []
        size = sum(f.stat().st_size for f in stored)
    else:
        size = sum(v.const_value.nbytes for v in model.graph.initializers.values()
                   if v.const_value is not None)  # fmt: skip
    return SHARED if size >= STOP_SPINNING_BYTES else SMALL


def _open(
    model: ir.Model | str, so: ort.SessionOptions, disabled: tuple[str, ...] = ()
) -> ort.InferenceSession:
    try:
        if isinstance(model, str | os.PathLike):
            return _session(str(model), so, disabled)
        return _session_from_ir(model, so, disabled)
    except KilnError:
        raise
    except Exception as exc:  # ORT raises many pybind types; all mean "cannot run this"
        raise KilnError(f"ONNX Runtime cannot load the model: {_explain(exc)}") from None


def _is_run(event: dict[str, Any]) -> bool:
    return event.get("cat") == "Session" and event.get("name") == "model_run"


_CONTROL_FLOW = frozenset({"If", "Loop", "Scan"})


def _kernel_records(events: list[dict[str, Any]]) -> list[KernelRecord]:
    """Node events of an ORT profile; the first run (the warm-up) is dropped, and so are
    control-flow nodes' own events: counted with the kernels inside, each would count twice."""
    records, run = [], -1
    for event in events:
        if _is_run(event):
            run += 1
        if run < 0 or event.get("cat") != "Node":
            continue
        if not event.get("name", "").endswith("_kernel_time"):
            continue
        args = event.get("args", {})
        if args.get("op_name") in _CONTROL_FLOW:
            continue  # its time holds its branch's or body's kernels, which ORT reports too
        records.append(
            KernelRecord(
                node=event["name"][: -len("_kernel_time")],
                op_type=args.get("op_name", ""),
                provider=args.get("provider", ""),
                dur_us=float(event.get("dur", 0)),
                run=run,
                ts_us=float(event.get("ts", 0)),
            )
        )
    return records


def _session(
    path_or_bytes: str | bytes, so: ort.SessionOptions, disabled: tuple[str, ...] = ()
) -> ort.InferenceSession:
    return ort.InferenceSession(
        path_or_bytes, so, providers=["CPUExecutionProvider"],
        disabled_optimizers=list(disabled) or None,
    )  # fmt: skip


def _session_from_ir(
    model: ir.Model, so: ort.SessionOptions, disabled: tuple[str, ...] = ()
) -> ort.InferenceSession:
    tensors = [v.const_value for v in model.graph.initializers.values() if v.const_value]
    size = sum(t.nbytes for t in tensors)
    # Weights still in an external file would be resolved against ORT's working directory
    # when the model comes as bytes, so such models also go through a file.
    external = any(isinstance(t, ir.ExternalTensor) for t in tensors)
    inline = sum(t.nbytes for t in tensors if not isinstance(t, ir.ExternalTensor))
    # The mapped path serializes the rest inline: a protobuf holds at most 2 GiB.
    mapped = mapped_weights(model) if external and inline < _INLINE_LIMIT else None
    if mapped is not None:  # a large model from a file: its weights shared where they lie
        session = session_on_mapped(model, so, mapped, disabled)
        if session is not None:
            return session
    if size < _INLINE_LIMIT and not external:
        return _session(ir.serde.serialize_model(model).SerializeToString(), so, disabled)
    with tempfile.TemporaryDirectory(prefix="kiln-ort-") as tmp:
        path = Path(tmp) / "model.onnx"
        ir.save(model, path, external_data="model.onnx.data")
        return _session(str(path), so, disabled)


# What ONNX Runtime wraps its messages in: status prefixes, the step that failed, and the C++
# source location with the function's signature ("graph.cc:1617 void onnxruntime::Graph::F()").
_STATUS = re.compile(r"\[ONNXRuntimeError\] : \d+ : \w+ : ")
_STEP = re.compile(r"Load model from .*? failed:|Exception during initialization: ")
_LOCATION = re.compile(r"\S*\.(?:cc|cpp|h|hpp|cu):\d+ ")
_NODE = re.compile(r"Non-zero status code returned while running (\S+) node\. Name:'([^']*)' ")


def _explain(exc: BaseException) -> str:
    """ONNX Runtime's message in one line, without its wrapping: what went wrong, where."""
    text = " ".join(str(exc).split("Stacktrace:")[0].split())
    if not text:
        return type(exc).__name__
    text = _STEP.sub("", _STATUS.sub("", text))
    parts = _LOCATION.split(text)
    text = " ".join(p.strip() for p in [parts[0], *map(_drop_function, parts[1:])] if p.strip())
    text = _NODE.sub(lambda m: f"node '{m[2]}' ({m[1]}): ", text).replace("Status Message: ", "")
    marker = "Could not find an implementation for "
    if marker in text:
        return "no kernel for " + text.split(marker, 1)[1] + " (op unsupported on CPU)"
    return text


def _drop_function(text: str) -> str:
    """The message after a source location, without the function named first: a signature
    ("void ns::F(T) const [with T = int]") or a bare name ("ValidateShape")."""
    paren = text.find("(")
    if paren > 0 and "::" in text[:paren] and ". " not in text[:paren]:
        depth = 0
        for index in range(paren, len(text)):
            depth += {"(": 1, ")": -1}.get(text[index], 0)
            if depth == 0:
                rest = text[index + 1 :].lstrip().removeprefix("const ").lstrip()
                if rest.startswith("[with "):  # a template's arguments
                    rest = rest.partition("] ")[2]
                return rest
        return text
    name, _, rest = text.partition(" ")
    return rest if re.fullmatch(r"[A-Za-z_][\w:<>~]*", name) else text
