"""OpenVINO backend: the second engine, behind the same contract as the ONNX Runtime one.

OpenVINO is optional: this module imports without it, `available()` is then False, and only
`compile` needs it. The ONNX model goes to OpenVINO's own ONNX front end; Kiln never converts
to OpenVINO IR files itself.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx_ir as ir

from kiln.backends.base import KernelRecord, Profile, check_flags
from kiln.backends.openvino_layers import Layer, OpenVinoKernelRecord, executed_layers
from kiln.backends.openvino_mapped import libraries as library_folders
from kiln.backends.openvino_mapped import mapped_files, release_state
from kiln.backends.release import SUPPORTED as RELEASE_SUPPORTED
from kiln.backends.release import Releasing
from kiln.errors import KilnError

if TYPE_CHECKING:
    import openvino as ov

HINTS = ("LATENCY", "THROUGHPUT")
PRECISIONS = ("f32", "bf16")
# Devices that dispatch to the real ones (AUTO:CPU, HETERO:GPU,CPU, ...).
_VIRTUAL_DEVICES = {"AUTO", "HETERO", "MULTI", "BATCH"}
# Input shapes whose first run releases the mapped weights (`release_mapped`): past this many,
# traffic of ever-new shapes runs without the watcher thread.
_SHAPES_TRACKED = 256
_NOTHING = contextlib.nullcontext()
# Serialized protobufs cannot exceed 2 GiB; above this, models go through a file with
# external data (as in ort.py).
_INLINE_LIMIT = 1 << 30
# Lines of OpenVINO's messages that say where in its C++ sources the check failed, or repeat
# the headline: they tell the user nothing.
_NOISE = (
    "Exception from ",
    "Check '",
    "FrontEnd API failed with",
    "Model wasn't fully converted",
    "Summary:",
    "-- Conversion is failed for",
    "To facilitate the conversion",
    "While validating node '",
)


@dataclass
class OpenVinoOptions:
    """Compile options. None / 0 mean OpenVINO's own default.

    `inference_precision` None lets OpenVINO choose, and it chooses bf16 on CPUs that support
    it (AMX, and also AVX512_BF16 without AMX): force "f32" for an fp32 comparison, and read
    the precision actually used from `OpenVinoExecutable.precision`.
    """

    device: str = "CPU"
    performance_hint: str = "LATENCY"
    inference_precision: str | None = None
    num_streams: int = 0
    inference_num_threads: int = 0
    cache_dir: str | None = None  # OpenVINO's compiled-model cache; None = off
    extra: dict[str, str] = field(default_factory=dict)
    # Symbolic dim name -> fixed size: the model is reshaped to static before compiling (one
    # executable per shape bucket, or an artifact compiled `static` at its verified dims);
    # static shapes can run faster (docs/contributing/engine-notes.md: BERT batch 8, 17 -> 24
    # samples/s on a Xeon; 0.95-1.04x elsewhere; NNCF int8 bert-base 1x128 on an AVX-512 EPYC
    # 0.99-1.04x over four readings). A run at other dims is not refused: the model is compiled
    # with its dynamic dims on first need (once; a second copy of the weights) and runs there.
    dim_overrides: dict[str, int] = field(default_factory=dict)
    # ENABLE_MMAP, given to read_model (per read: the process's one Core is left as it is):
    # True (OpenVINO's default) maps an external-data weights file and compiles from the
    # mapping; False reads the weights into memory. Either way the CPU plugin keeps the
    # original weights beside its repacked copy (resident ≈ 2 × weights): mapped, they are
    # clean file pages the kernel can take back (and `release_mapped` gives back); read, they
    # are the process's own memory.
    # Weights inside the .onnx file are always read.
    mmap: bool = True
    # With `mmap`, give the mapped weight pages back once OpenVINO has its own copy
    # (kiln.backends.release: madvise(MADV_DONTNEED) on the file's shared read-only mapping,
    # while compiling and while the first run at each input shape repacks; Linux only, a no-op
    # elsewhere). bert-base fp32, peak over 21 runs: 812 -> 470 MiB (floor 441), compile peak
    # 662 -> 253; NNCF int8: 355 -> 246 MiB (floor 196; the heap trimmed after each,
    # `trim_heap`); latency within noise (benchmarks/openvino_memory.py). Outputs are
    # bit-identical; a weight the engine reads in place (the fp32 embedding table) faults back
    # from the page cache and stays.
    release_mapped: bool = True
    # Give back the pages of OpenVINO's own libraries that the compile and the first run at
    # each input shape read and inference never reads again (graph transformations, kernel
    # generation; kiln.backends.release.release_code: madvise(MADV_PAGEOUT), Linux only).
    # NNCF int8 bert-base, steady peak above the process before the compile: 173 -> 132 MiB;
    # the next run pays once to fault back the code it uses (36 -> 60 ms), and so does every
    # other OpenVINO model in the process (benchmarks/openvino_memory.py).
    release_code: bool = True
    # Steadiness decisions; None leaves OpenVINO's own default. `flush_denormals`:
    # CPU_DENORMALS_OPTIMIZATION, the CPU plugin's threads flush denormals to zero (FTZ/DAZ;
    # off by default; once a compiled model turned it on, the plugin's threads keep it for
    # the process). `pin_threads`: ENABLE_CPU_PINNING, its inference threads pinned to cores
    # (on by default on Linux, with the LATENCY hint and with THROUGHPUT).
    flush_denormals: bool | None = None
    pin_threads: bool | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> OpenVinoOptions:
        return cls(**data)

    def properties(self) -> dict[str, str]:
        """The compile_model config; bad values are named here rather than by OpenVINO."""
        if self.performance_hint not in HINTS:
            raise KilnError(
                f"unknown OpenVINO performance hint '{self.performance_hint}'; "
                f"use one of {', '.join(HINTS)}."
            )
        if self.inference_precision not in (*PRECISIONS, None):
            raise KilnError(
                f"unknown OpenVINO inference precision '{self.inference_precision}'; "
                f"use one of {', '.join(PRECISIONS)}, or none for OpenVINO's default."
            )
        check_flags(
            "OpenVINO",
            self,
            ("mmap", "release_mapped", "release_code"),
            ("flush_denormals", "pin_threads"),
        )
        props = {"PERFORMANCE_HINT": self.performance_hint}
        if self.inference_precision is not None:
            props["INFERENCE_PRECISION_HINT"] = self.inference_precision
        if self.num_streams > 0:
            props["NUM_STREAMS"] = str(self.num_streams)
        if self.inference_num_threads > 0:
            props["INFERENCE_NUM_THREADS"] = str(self.inference_num_threads)
        if self.cache_dir is not None:
            props["CACHE_DIR"] = str(self.cache_dir)
        if self.flush_denormals is not None:
            props["CPU_DENORMALS_OPTIMIZATION"] = "YES" if self.flush_denormals else "NO"
        if self.pin_threads is not None:
            props["ENABLE_CPU_PINNING"] = "YES" if self.pin_threads else "NO"
        props.update(self.extra)
        return props


class OpenVinoExecutable:
    """An OpenVINO CompiledModel behind Kiln's Executable contract.

    `run` is thread-safe, as an ONNX Runtime session's is: each call takes an idle
    InferRequest (a request is not thread-safe), made on first need and then kept for the next
    call (creating one per call costs more than a small model's inference); OpenVINO runs
    concurrent requests on the compiled model's streams.
    """

    def __init__(
        self,
        compiled: ov.CompiledModel,
        names: tuple[list[str], list[str]],
        options: OpenVinoOptions,
        model: ir.Model | str,
        mapped: tuple[str, ...] = (),
        libraries: tuple[str, ...] = (),
    ) -> None:
        import openvino as ov

        self.compiled = compiled
        self.options = options
        self._model = model  # kept to compile a profiling model on demand
        self.input_names, self.output_names = list(names[0]), list(names[1])
        self.providers = [f"OpenVINO:{options.device}"]
        self._output_index = {name: i for i, name in enumerate(self.output_names)}
        self._inputs = {
            name: (port.get_element_type().to_dtype(), port.get_partial_shape())
            for name, port in zip(self.input_names, compiled.inputs, strict=True)
        }
        self._partial_shape = ov.PartialShape
        self._idle = [compiled.create_infer_request()]
        self._generation = 0  # bumped when a failed run's compiled model is replaced
        self._refused: dict[tuple[tuple[int, ...], ...], str] = {}  # input shapes that failed
        self._lock = threading.Lock()  # the idle requests, the renewal, the dynamic compile
        # The weight files to release (options.release_mapped) and the input shapes already
        # run: the first run at a shape repacks weights from the mapping, the next ones do not.
        self._mapped = mapped
        self._libraries = libraries
        self._shapes: set[tuple[tuple[int, ...], ...]] = set()
        self._dynamic: OpenVinoExecutable | None = None  # see dynamic()

    @property
    def precision(self) -> str:
        """The precision OpenVINO actually computes in ("f32", "bf16", ...), read back."""
        value = self._property("INFERENCE_PRECISION_HINT")
        return value.get_type_name() if hasattr(value, "get_type_name") else str(value)

    def layer_precisions(self) -> dict[str, tuple[str, str]]:
        """Original node → (precision OpenVINO runs it in, the kernel's layer type), read from
        the runtime model: e.g. LayerNorm stays f32 (MVN) under a bf16 hint."""
        out: dict[str, tuple[str, str]] = {}
        for op in self.compiled.get_runtime_model().get_ordered_ops():
            info = op.get_rt_info()
            if "originalLayersNames" not in info or "runtimePrecision" not in info:
                continue
            kind = str(info["layerType"].astype(str)) if "layerType" in info else "?"
            if kind in ("Input", "Output", "Const", "Reorder", "Convert"):
                continue  # plumbing, not computation
            precision = str(info["runtimePrecision"].astype(str))
            for name in str(info["originalLayersNames"].astype(str)).split(","):
                if name:
                    out[name] = (precision, kind)
        return out

    def settings(self) -> dict[str, str]:
        """What OpenVINO made of the options: for manifests and reports."""
        devices = self._property("EXECUTION_DEVICES")
        return {
            "device": ",".join(devices) if isinstance(devices, list) else str(devices),
            "precision": self.precision,
            "performance_hint": str(self._property("PERFORMANCE_HINT")),
            "num_streams": str(self._property("NUM_STREAMS")),
            "inference_num_threads": str(self._property("INFERENCE_NUM_THREADS")),
            "flush_denormals": str(self._property("CPU_DENORMALS_OPTIMIZATION")),
            "pin_threads": str(self._property("ENABLE_CPU_PINNING")),
            "release_mapped": release_state(self.options, self._mapped),
            "release_code": "on" if self._libraries else "off",
        }

    def _property(self, key: str) -> Any:
        # Virtual devices (AUTO, MULTI) do not answer every property the CPU plugin does.
        try:
            return self.compiled.get_property(key)
        except RuntimeError:
            return "unknown"

    def run(
        self, feeds: dict[str, np.ndarray], output_names: list[str] | None = None
    ) -> list[np.ndarray]:
        if not self._check(feeds):
            return self.dynamic().run(feeds, output_names)
        wanted = self.output_names if output_names is None else output_names
        unknown = [n for n in wanted if n not in self._output_index]
        if unknown:
            raise KilnError(
                f"unknown output '{unknown[0]}'; the model's outputs are "
                f"{', '.join(self.output_names)}."
            )
        shapes = tuple(np.shape(feeds[n]) for n in self.input_names)
        if shapes in self._refused:  # refused before: not run again (see _renew)
            raise KilnError(self._refused[shapes])
        with self._lock:
            generation = self._generation
            request = self._idle.pop() if self._idle else self.compiled.create_infer_request()
        try:
            # share_outputs: no copy of every output; the ones asked for are copied below,
            # because the request overwrites its output buffers on the next call.
            with self._first_at_shape(feeds):
                request.infer(feeds, share_inputs=True, share_outputs=True)
            outputs = [
                np.array(request.get_output_tensor(self._output_index[n]).data, copy=True)
                for n in wanted
            ]
        except RuntimeError as exc:
            message = f"invalid inputs: {_explain(exc)}"
            if len(self._refused) < _SHAPES_TRACKED:
                self._refused[shapes] = message
            self._renew(generation)
            raise KilnError(message) from None
        with self._lock:
            if generation == self._generation:  # a request of a renewed model is dropped
                self._idle.append(request)
        return outputs

    def _renew(self, generation: int) -> None:
        """A fresh compiled model in place of one a failed run broke: after a shape its graph
        cannot take, OpenVINO's compiled model (latency hint) answers NaN at every shape from
        then on, from every request (PP-OCRv4's recogniser at 224x224). The shapes that failed
        are refused from then on without running, so a client repeating one costs no compile."""
        with self._lock:
            if generation != self._generation:
                return  # another thread renewed it already
            with Releasing(self._mapped, self._libraries):
                compiled, _ = _compile(
                    self._model, self.options.device, self.options.properties(),
                    self.options.dim_overrides, self.options.mmap,
                )  # fmt: skip
            self.compiled, self._idle = compiled, []
            self._generation += 1

    def _first_at_shape(self, feeds: dict[str, np.ndarray]) -> AbstractContextManager[object]:
        """While the first run at these input shapes repacks weights from the mapping, their
        pages released as they are read (`release_mapped`), and the library pages it read given
        back after it (`release_code`); nothing for a shape run before."""
        if not (self._mapped or self._libraries) or len(self._shapes) >= _SHAPES_TRACKED:
            return _NOTHING
        key = tuple(np.shape(feeds[n]) for n in self.input_names)
        if key in self._shapes:
            return _NOTHING
        self._shapes.add(key)
        return Releasing(self._mapped, self._libraries)

    def dynamic(self) -> OpenVinoExecutable:
        """The model compiled with its dynamic dims, for runs at dims other than the fixed ones
        `dim_overrides` compiled this executable for: compiled on first need, then kept."""
        with self._lock:
            if self._dynamic is None:
                options = replace(self.options, dim_overrides={})
                self._dynamic = OpenVinoBackend().compile(self._model, options)
        return self._dynamic

    def _check(self, feeds: dict[str, np.ndarray]) -> bool:
        """Whether `feeds` fit this compile; False where only the shapes differ from the fixed
        dims of `dim_overrides` (the dynamic compile takes them); anything else is refused."""
        # OpenVINO converts a wrong dtype silently and reuses the previous tensor for a
        # missing input; ONNX Runtime refuses both, and so does Kiln.
        missing = [n for n in self.input_names if n not in feeds]
        if missing:
            raise KilnError(f"invalid inputs: missing input '{missing[0]}'.")
        fits = True
        for name, value in feeds.items():
            if name not in self._inputs:
                raise KilnError(
                    f"invalid inputs: unknown input '{name}'; the model's inputs are "
                    f"{', '.join(self.input_names)}."
                )
            array = np.asarray(value)
            dtype, shape = self._inputs[name]
            if array.dtype != dtype:
                raise KilnError(
                    f"invalid inputs: input '{name}' must be {dtype}, got {array.dtype}."
                )
            given = self._partial_shape(list(array.shape))
            if not shape.compatible(given):
                if self.options.dim_overrides:
                    fits = False
                    continue
                raise KilnError(
                    f"invalid inputs: input '{name}' must have shape {shape}, got {given}."
                )
        return fits

    def profile(self, feeds: dict[str, np.ndarray], runs: int) -> Profile:
        """Per-layer records from OpenVINO's performance counters over `runs` runs after one
        warm-up: the exec type as `provider` (the kernel, e.g. brgconv_avx512_f32), the
        original layers fused into each as `origin`, and from the runtime model its place in
        the execution order, the precision it ran in and the bytes it moved
        (`OpenVinoKernelRecord`); each run's wall time as timed here.

        PERF_COUNT slows every layer a little, so it lives in a separate compiled model. Each
        compile names the layers OpenVINO creates anew (Multiply_4791, then Multiply_18761):
        `order` is what stays the same from one compile to the next."""
        if not self._check(feeds):
            return self.dynamic().profile(feeds, runs)
        props = {**self.options.properties(), "PERF_COUNT": "YES"}
        # A profiling build must neither come from nor land in the model cache.
        props.pop("CACHE_DIR", None)
        compiled, _ = _compile(
            self._model, self.options.device, props, self.options.dim_overrides, self.options.mmap
        )
        request = compiled.create_infer_request()
        request.infer(feeds, share_inputs=True, share_outputs=True)
        # Read after an inference: only then does a dynamic model's runtime model hold the
        # shapes these feeds gave every layer.
        layers = executed_layers(compiled)
        records: list[KernelRecord] = []
        run_ms: list[float] = []
        for run in range(runs):
            start = time.perf_counter()
            request.infer(feeds, share_inputs=True, share_outputs=True)
            run_ms.append((time.perf_counter() - start) * 1e3)
            # The counters describe the last inference only, not a running total.
            for info in request.get_profiling_info():
                # NOT_RUN: fused into a neighbour or a no-op (Parameter, Result): no time.
                if info.status != info.Status.EXECUTED:
                    continue
                layer = layers.get(info.node_name, Layer(origin=(info.node_name,)))
                records.append(
                    OpenVinoKernelRecord(
                        node=info.node_name,
                        op_type=info.node_type,
                        provider=info.exec_type,
                        dur_us=info.real_time.total_seconds() * 1e6,
                        run=run,
                        origin=layer.origin,
                        order=layer.order,
                        precision=layer.precision,
                        bytes=layer.bytes,
                    )
                )
        return Profile(records, run_ms, engine="openvino")


class OpenVinoBackend:
    name = "openvino"

    def available(self) -> bool:
        try:
            import openvino  # noqa: F401
        except ImportError:
            return False
        return True

    def describe(self) -> dict[str, str]:
        import openvino as ov

        core = _core()
        devices = core.available_devices
        out = {"engine": "openvino", "version": ov.__version__.split("-")[0]}
        out["devices"] = ",".join(devices)
        if "CPU" in devices:
            out["cpu_capabilities"] = ",".join(
                core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")
            )
            # The plugin's default precision: what a model gets unless told otherwise.
            default = core.get_property("CPU", "INFERENCE_PRECISION_HINT")
            out["cpu_default_precision"] = default.get_type_name()
        return out

    def compile(
        self, model: ir.Model | str, options: OpenVinoOptions | None = None
    ) -> OpenVinoExecutable:
        if not self.available():
            raise KilnError("backend 'openvino' is not installed; pip install openvino.")
        options = options or OpenVinoOptions()
        props = options.properties()
        mapped = mapped_files(model, options)
        libraries = library_folders() if options.release_code and RELEASE_SUPPORTED else ()
        with Releasing(mapped, libraries):
            compiled, names = _compile(
                model, options.device, props, options.dim_overrides, options.mmap
            )
        return OpenVinoExecutable(compiled, names, options, model, mapped, libraries)


@functools.cache
def cpu_runs_bf16() -> bool:
    """Whether OpenVINO's CPU plugin has bf16 kernels here (AMX or AVX512_BF16)."""
    return "BF16" in _core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")


@functools.cache
def _core() -> ov.Core:
    # One Core per process: it loads the device plugins, which takes longer than a small
    # model's compile, and it is safe to share between threads.
    import openvino as ov

    return ov.Core()


def _compile(
    model: ir.Model | str,
    device: str,
    props: dict[str, str],
    dim_overrides: dict[str, int] | None = None,
    mmap: bool = True,
) -> tuple[ov.CompiledModel, tuple[list[str], list[str]]]:
    _check_device(device)
    try:
        with _read(model, mmap) as ov_model:
            if dim_overrides:
                ov_model.reshape(_fixed_shapes(model, dim_overrides))
            names = (
                [_port_name(p) for p in ov_model.inputs],
                [_port_name(p) for p in ov_model.outputs],
            )
            return _core().compile_model(ov_model, device, props), names
    except KilnError:
        raise
    except Exception as exc:  # RuntimeError mostly; every kind means "cannot compile this"
        raise KilnError(f"OpenVINO cannot compile the model: {_explain(exc)}") from None


def _check_device(device: str) -> None:
    # Without this, a missing device shows up as a failure to load its plugin's shared library.
    available = {d.split(".")[0] for d in _core().available_devices}
    base = device.split(":")[0].split(".")[0]
    if base not in available | _VIRTUAL_DEVICES:
        raise KilnError(
            f"OpenVINO device '{device}' is not available here; available: "
            f"{', '.join(sorted(available))}."
        )


@contextlib.contextmanager
def _read(model: ir.Model | str, mmap: bool = True) -> Iterator[ov.Model]:
    """`model` as OpenVINO reads it, for the block that compiles it."""
    core = _core()
    if isinstance(model, str | os.PathLike):
        if not Path(model).is_file():
            raise KilnError(f"model file '{model}' not found.")
        yield core.read_model(str(model), config={"ENABLE_MMAP": bool(mmap)})
        return
    tensors = [v.const_value for v in model.graph.initializers.values() if v.const_value]
    size = sum(t.nbytes for t in tensors)
    # Weights still in an external file would be resolved against the working directory when
    # the model comes as bytes, so such models also go through a file.
    external = any(isinstance(t, ir.ExternalTensor) for t in tensors)
    if size < _INLINE_LIMIT and not external:
        yield core.read_model(ir.serde.serialize_model(model).SerializeToString())
        return
    with tempfile.TemporaryDirectory(prefix="kiln-ov-") as tmp:
        path = Path(tmp) / "model.onnx"
        ir.save(model, path, external_data="model.onnx.data")
        # No mmap: the compiled model must not need the file once it is gone. OpenVINO still
        # reads some weights from it while it compiles (its int8 MatMul transformation), so
        # the file lives until the block's compile is done.
        yield core.read_model(str(path), config={"ENABLE_MMAP": False})


def _fixed_shapes(model: ir.Model | str, dim_overrides: dict[str, int]) -> dict[str, list[int]]:
    """Input name -> shape with the named dims fixed (-1 stays dynamic). OpenVINO's reader
    drops ONNX dim names, so they are read from the ONNX graph itself."""
    graph = (ir.load(str(model)) if isinstance(model, str | os.PathLike) else model).graph
    shapes = {}
    for value in graph.inputs:
        if value.name in graph.initializers or value.shape is None:
            continue
        shapes[value.name] = [
            d if isinstance(d, int) else dim_overrides.get(str(d.value), -1) for d in value.shape
        ]
    return shapes


def _port_name(port: Any) -> str:
    """The ONNX name of an input or output: OpenVINO may give a tensor several names (when
    Identity nodes are folded); the ONNX front end names an output's Result '<name>/sink_port_0'."""
    names = port.get_names()
    if len(names) == 1:
        return next(iter(names))
    node_name = port.get_node().get_friendly_name().removesuffix("/sink_port_0")
    return node_name if node_name in names else sorted(names)[0]


def _explain(exc: BaseException) -> str:
    """One line out of OpenVINO's multi-line messages: the reason, not the C++ location."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        if line.startswith("-- No conversion rule found for operations:"):
            ops = line.split(":", 1)[1].strip()
            return f"no conversion rule for operation(s) {ops} (unsupported by OpenVINO)"
    useful = [line for line in lines if not line.startswith(_NOISE)]
    node = next((line for line in useful if line.startswith("While validating ONNX node")), None)
    if node is not None:
        # "While validating ONNX node '<Node(MatMul): mm>': Check ..." + the reason below it
        match = re.search(r"<Node\((.+?)\): (.*?)>", node)
        where = f"node '{match[2]}' ({match[1]})" if match else node
        reasons = [line for line in useful if not line.startswith(("While validating", "--"))]
        return f"{where}: {reasons[-1] if reasons else 'validation failed'}"
    useful = [line for line in useful if not line.startswith("--")]
    return useful[0] if useful else (lines[0] if lines else type(exc).__name__)
