"""Practical peaks of this machine, measured with the engines Kiln drives and cached on disk.

The roofline needs the limits a model can actually reach here, not datasheet numbers: the
GFLOP/s of GEMMs with constant weights in ONNX Runtime and OpenVINO, the faster of the two
and of a few sizes (fp32; int8 through MatMulInteger and OpenVINO's QDQ kernels, which use
VNNI/AMX where present; bf16 in OpenVINO where the CPU has bf16 instructions), the memory
bandwidth of large array copies, and the bandwidth of the L2 and L3 caches (copies of arrays
that fit in them): a kernel whose working set fits in a cache is held to that cache's
bandwidth, not memory's. One measurement takes about 15 s (at most ~30 s); the result is
kept under ``$KILN_HOME/hardware/<hardware fingerprint>.json``. A cache written before the
cache ceilings were measured (and the GEMM peaks taken over both engines) is measured again.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import MISSING, asdict, dataclass, fields
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import KilnError
from kiln.hardware.cpu import cpu_info
from kiln.home import kiln_home, read_cache_json, write_cache_json

_SECONDS_PER_PEAK = 1.0  # timing budget per measured figure; best run wins
_SECONDS_PER_GEMM = 0.5  # ... per engine and GEMM size (the best of them is the figure)
# GEMM sizes (n, doubled above 8 threads): from operands that fit in L2 to ones that do not
_GEMM_SIZES = (256, 512, 1024)
# per array of the memory bandwidth copies: four times the L3 (so it cannot help), at least
# 32 MiB; 128 MiB where the L3 is unknown. Shorter copies find more of the quiet moments of a
# shared machine.
_BANDWIDTH_BYTES = 128 << 20
_BANDWIDTH_MIN_BYTES = 32 << 20
_CACHE_BYTES_PER_CALL = 32 << 20  # bytes each thread moves per timed call of a cache copy
_CACHE_KEYS = ("l2_bytes", "l2_bandwidth_gbs", "l3_bytes", "l3_bandwidth_gbs")
# OpenVINO's layer types of a matrix product (its runtime model's layerType)
_OV_MATMULS = {"FullyConnected", "MatMul", "Convolution"}


@dataclass(frozen=True)
class Peaks:
    """Measured practical peaks. None: this machine or its engines have no such kernels."""

    fp32_gflops: float
    bf16_gflops: float | None
    int8_gops: float | None
    bandwidth_gbs: float
    threads: int
    measured_at: str  # ISO 8601, UTC
    # 1-minute load average when measured: on a busy machine every peak comes out low
    load_average: float | None = None
    # Cache ceilings: the size of the L2 and L3 over the cores used, and the bandwidth of
    # copies that fit in them. None: not found or not measured (memory's bandwidth applies).
    l2_bytes: int | None = None
    l2_bandwidth_gbs: float | None = None
    l3_bytes: int | None = None
    l3_bandwidth_gbs: float | None = None
    # The share of the cores other processes (and the hypervisor's steal) took while the peaks
    # were measured: unlike the load average, not counting this process's own work before
    others_busy: float | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def memory_levels(self) -> list[tuple[str, int | None, float]]:
        """(level, bytes it holds or None for memory, GB/s), smallest first: the caches
        measured, then memory."""
        levels: list[tuple[str, int | None, float]] = [("DRAM", None, self.bandwidth_gbs)]
        for name, size, speed in (
            ("L3", self.l3_bytes, self.l3_bandwidth_gbs),
            ("L2", self.l2_bytes, self.l2_bandwidth_gbs),
        ):
            if size and speed:  # never below the level above it: that is noise
                levels.insert(0, (name, size, max(speed, levels[0][2])))
        return levels

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Peaks:
        """Rebuild from `to_json`; ValueError/TypeError/KeyError on anything malformed."""
        given = {
            f.name: data[f.name] if f.default is MISSING else data.get(f.name, f.default)
            for f in fields(cls)
        }
        peaks = cls(**given)
        numbers = [
            peaks.fp32_gflops,
            peaks.bandwidth_gbs,
            peaks.bf16_gflops,
            peaks.int8_gops,
            *(getattr(peaks, key) for key in _CACHE_KEYS),
        ]
        if not all(v is None or (isinstance(v, int | float) and v > 0) for v in numbers):
            raise ValueError("peaks must be positive numbers")
        if None in numbers[:2] or not isinstance(peaks.threads, int):
            raise ValueError("fp32, bandwidth and threads are required")
        return peaks


def measured_peaks(
    refresh: bool = False, *, progress: Callable[[str], None] | None = None
) -> Peaks:
    """This machine's peaks: from the cache, or measured (and cached) on first use.

    ``refresh`` measures again. A cache file that cannot be read or parsed is measured over,
    never trusted. ``progress`` is told the name of each step while measuring.
    """
    path = cache_path()
    if not refresh:
        cached = _load(path)
        if cached is not None:
            return cached
    peaks = measure(progress)
    save_peaks(path, peaks)
    return peaks


def cache_path() -> Path:
    """Where this machine's peaks are cached: ``$KILN_HOME/hardware/<fingerprint>.json``."""
    return kiln_home() / "hardware" / f"{cpu_info().fingerprint}.json"


def measure(progress: Callable[[str], None] | None = None) -> Peaks:
    """Measure every peak now (no cache)."""
    say = progress or (lambda _step: None)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    start = _cpu_seconds()
    threads = cpu_info().physical_cores  # hyper-threads add nothing to a GEMM's throughput
    say("fp32 GEMM (ONNX Runtime, OpenVINO)")
    fp32 = _gemm_gflops("fp32", threads)
    if fp32 is None:
        raise KilnError("could not measure the fp32 GEMM peak: no engine could run it.")
    say("int8 GEMM (ONNX Runtime MatMulInteger, OpenVINO QDQ)")
    int8 = _gemm_gflops("int8", threads)
    features = set(cpu_info().features)
    bf16 = None
    if features & {"avx512_bf16", "amx_bf16"}:  # elsewhere bf16 is emulated: not a peak
        say("bf16 GEMM (OpenVINO)")
        bf16 = _gemm_gflops("bf16", threads)
    say("memory bandwidth (copy, triad)")
    bandwidth = _bandwidth_gbs(threads)
    others = others_busy(start, _cpu_seconds(), cpu_info().logical_cores)
    return Peaks(
        fp32_gflops=round(fp32, 1),
        bf16_gflops=None if bf16 is None else round(bf16, 1),
        int8_gops=None if int8 is None else round(int8, 1),
        bandwidth_gbs=round(bandwidth, 2),
        threads=threads,
        measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        load_average=None if load is None else round(load, 2),
        others_busy=None if others is None else round(others, 3),
        **_cache_ceilings(threads, progress),
    )


# (wall clock, every core's busy seconds, this process's CPU seconds), or None off Linux
CpuSeconds = tuple[float, float, float]


def _cpu_seconds() -> CpuSeconds | None:
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal: busy is all but idle and iowait; steal
    # (another VM on these cores) counts as someone else's work
    busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")
    return time.monotonic(), busy, sum(os.times()[:4])


def others_busy(start: CpuSeconds | None, end: CpuSeconds | None, cores: int) -> float | None:
    """The share of `cores` that everything but this process kept busy between two
    `_cpu_seconds` readings (0: the machine was ours)."""
    if start is None or end is None or end[0] <= start[0]:
        return None
    others = (end[1] - start[1]) - (end[2] - start[2])
    return min(max(others / ((end[0] - start[0]) * cores), 0.0), 1.0)


def _cache_ceilings(
    threads: int, progress: Callable[[str], None] | None = None
) -> dict[str, int | float | None]:
    """The `Peaks` cache fields: each level's size over the cores used, and the bandwidth of
    copies that fit in it (half of each thread's share of it, so the arrays stay in). L3 is
    measured only where it holds more than the L2s: elsewhere a copy of its size measures L2."""
    say = progress or (lambda _step: None)
    sizes = cpu_info().caches
    out: dict[str, int | float | None] = dict.fromkeys(_CACHE_KEYS)
    below = 0
    for level in ("L2", "L3"):
        size = sizes.get(level)
        if not size or size <= 2 * below:
            continue
        say(f"{level} cache bandwidth (copies of {size // threads // 2 >> 10} KiB per core)")
        key = level.lower()
        out[f"{key}_bytes"] = size
        out[f"{key}_bandwidth_gbs"] = round(_cache_bandwidth_gbs(size // threads // 2, threads), 2)
        below = size
    return out


# ---------------------------------------------------------------------------- internals
def _gemm_gflops(precision: str, threads: int) -> float | None:
    """GFLOP/s (2 per multiply-accumulate) of an n×n×n MatMul with a constant weight, as a
    real model's layer is (engines pre-pack constant weights), in the fastest of the engines
    that have kernels of that precision and of a few sizes: a profile puts either engine's
    kernels under this roof, and a layer whose operands sit in cache runs faster than a GEMM
    too big for it ("Measuring on a shared machine" in docs/contributing/engine-notes.md).
    None if no engine runs it in that precision."""
    engines = ("openvino",) if precision == "bf16" else ("ort", "openvino")
    sizes = _GEMM_SIZES if threads <= 8 else tuple(2 * n for n in _GEMM_SIZES)
    found = [
        speed
        for engine in engines
        for n in sizes
        if (speed := _engine_gemm(engine, precision, threads, n))
    ]
    return max(found) if found else None


def _engine_gemm(engine: str, precision: str, threads: int, n: int) -> float | None:
    from kiln.backends import OpenVinoOptions, OrtOptions, get_backend

    rng = np.random.default_rng(0)
    if precision == "int8" and engine == "ort":  # u8 × s8 is the form VNNI and AMX take
        feed = rng.integers(0, 256, (n, n), dtype=np.uint8)
        model = _matmul_model(feed, rng.integers(-128, 128, (n, n), dtype=np.int8))
    else:  # OpenVINO computes int8 from a QDQ graph, bf16 from an fp32 one
        feed = rng.standard_normal((n, n), dtype=np.float32)
        weight = rng.standard_normal((n, n), dtype=np.float32)
        build = _qdq_matmul_model if precision == "int8" else _matmul_model
        model = build(feed, weight)
    try:
        if not get_backend(engine).available():
            return None
        if engine == "ort":
            exe = get_backend("ort").compile(model, OrtOptions(intra_op_threads=threads))
        else:
            hint = {"fp32": "f32", "bf16": "bf16"}.get(precision)
            options = OpenVinoOptions(inference_precision=hint, inference_num_threads=threads)
            exe = get_backend("openvino").compile(model, options)
            if not _runs_in(exe, precision):  # OpenVINO fell back to another precision
                return None
        seconds = _best_seconds(lambda: exe.run({"a": feed}), budget=_SECONDS_PER_GEMM)
    except KilnError:
        return None
    return 2 * n**3 / seconds / 1e9


def _runs_in(exe: Any, precision: str) -> bool:
    """Whether OpenVINO's matrix product runs in `precision` (read back from the engine)."""
    if precision in ("fp32", "bf16"):
        return exe.precision == {"fp32": "f32", "bf16": "bf16"}[precision]
    kinds = exe.layer_precisions().values()
    return any(kind in _OV_MATMULS and p in ("u8", "i8") for p, kind in kinds)


def _matmul_model(feed: np.ndarray, weight: np.ndarray) -> Any:
    import onnx_ir as ir
    from onnx import helper, numpy_helper

    integer = feed.dtype == np.uint8
    op = "MatMulInteger" if integer else "MatMul"
    in_type = helper.np_dtype_to_tensor_dtype(feed.dtype)
    out_type = helper.np_dtype_to_tensor_dtype(np.dtype(np.int32 if integer else np.float32))
    shape = [feed.shape[0], weight.shape[1]]  # static: OpenVINO's CPU plug-in needs the rank
    graph = helper.make_graph(
        [helper.make_node(op, ["a", "w"], ["y"])],
        "kiln-peak",
        [helper.make_tensor_value_info("a", in_type, list(feed.shape))],
        [helper.make_tensor_value_info("y", out_type, shape)],
        [numpy_helper.from_array(weight, "w")],
    )
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def _qdq_matmul_model(feed: np.ndarray, weight: np.ndarray) -> Any:
    """fp32 MatMul with QuantizeLinear/DequantizeLinear on both operands (u8 activations,
    s8 weights): the form OpenVINO runs as an int8 kernel."""
    import onnx_ir as ir
    from onnx import TensorProto, helper, numpy_helper

    scale = float(np.abs(weight).max()) / 127
    constants = {
        "w": np.clip(np.round(weight / scale), -127, 127).astype(np.int8),
        "ws": np.array(scale, np.float32),
        "wz": np.array(0, np.int8),
        "as": np.array(float(np.abs(feed).max()) / 127, np.float32),
        "az": np.array(128, np.uint8),
    }
    nodes = [
        helper.make_node("QuantizeLinear", ["a", "as", "az"], ["aq"]),
        helper.make_node("DequantizeLinear", ["aq", "as", "az"], ["adq"]),
        helper.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wdq"]),
        helper.make_node("MatMul", ["adq", "wdq"], ["y"]),
    ]
    shape = [feed.shape[0], weight.shape[1]]
    graph = helper.make_graph(
        nodes,
        "kiln-peak-int8",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, list(feed.shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)],
        [numpy_helper.from_array(v, k) for k, v in constants.items()],
    )
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


def _best_seconds(run: Callable[[], object], budget: float = _SECONDS_PER_PEAK) -> float:
    """Fastest of as many runs as fit in the budget (at least 3), after one warm-up: on a
    shared machine the fastest run is the one least disturbed by others."""
    run()
    best, start, count = float("inf"), time.perf_counter(), 0
    while count < 3 or time.perf_counter() - start < budget:
        t0 = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t0)
        count += 1
    return best


def _bandwidth_gbs(threads: int) -> float:
    """GB/s of the better of a copy (b → a) and a triad (a = b + s·c) over arrays far larger
    than the caches, split over the cores (numpy releases the GIL in both).

    Bytes counted as STREAM does (copy: 2 arrays, triad: 3), except that numpy's triad takes
    two passes (a = s·c, then a += b) and so moves 5 arrays' worth."""
    l3 = cpu_info().caches.get("L3")
    n = (max(4 * l3, _BANDWIDTH_MIN_BYTES) if l3 else _BANDWIDTH_BYTES) // 8
    a, b, c = np.zeros(n), np.ones(n), np.full(n, 2.0)
    parts = [slice(i * n // threads, (i + 1) * n // threads) for i in range(threads)]

    def copy(s: slice) -> None:
        np.copyto(a[s], b[s])

    def triad(s: slice) -> None:
        np.multiply(c[s], 3.0, out=a[s])
        np.add(a[s], b[s], out=a[s])

    with ThreadPoolExecutor(threads) as pool:

        def timed(kernel: Callable[[slice], None]) -> float:
            return _best_seconds(lambda: list(pool.map(kernel, parts)), budget=0.6)

        copy_gbs = 2 * a.nbytes / timed(copy) / 1e9
        triad_gbs = 5 * a.nbytes / timed(triad) / 1e9
    return max(copy_gbs, triad_gbs)


def _cache_bandwidth_gbs(working_set: int, threads: int) -> float:
    """GB/s of the better of a copy (b → a) and an add (a += b) over arrays of `working_set`
    bytes per thread together, repeated in each thread until it has moved
    `_CACHE_BYTES_PER_CALL` (numpy's call overhead would otherwise hide the cache)."""
    n = max(working_set // 16, 1024)  # two float64 arrays per thread
    arrays = [(np.zeros(n), np.ones(n)) for _ in range(threads)]

    def copy(pair: tuple[np.ndarray, np.ndarray]) -> None:
        for _ in range(max(_CACHE_BYTES_PER_CALL // (16 * n), 1)):
            np.copyto(pair[0], pair[1])

    def add(pair: tuple[np.ndarray, np.ndarray]) -> None:
        for _ in range(max(_CACHE_BYTES_PER_CALL // (24 * n), 1)):
            np.add(pair[0], pair[1], out=pair[0])

    with ThreadPoolExecutor(threads) as pool:

        def timed(kernel: Callable[[tuple[np.ndarray, np.ndarray]], None]) -> float:
            return _best_seconds(lambda: list(pool.map(kernel, arrays)), budget=0.4)

        moved_copy = 16 * n * max(_CACHE_BYTES_PER_CALL // (16 * n), 1) * threads
        moved_add = 24 * n * max(_CACHE_BYTES_PER_CALL // (24 * n), 1) * threads
        return max(moved_copy / timed(copy), moved_add / timed(add)) / 1e9


def _load(path: Path) -> Peaks | None:
    """The cached peaks, or None when the file is missing, truncated, edited into something
    malformed, written on another machine, or written before the cache ceilings were
    measured (a None in it is an answer: that cache was not found): then they are measured
    again."""
    data = read_cache_json(path)
    if data.get("fingerprint") != cpu_info().fingerprint:
        return None
    try:
        if not set(_CACHE_KEYS) <= set(data["peaks"]):
            return None
        return Peaks.from_json(data["peaks"])
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def save_peaks(path: Path, peaks: Peaks) -> None:
    """Write atomically (no reader sees half a file); an unwritable KILN_HOME costs a
    re-measurement next time, nothing else."""
    data = {"fingerprint": cpu_info().fingerprint, "cpu": cpu_info().to_json()}
    data["peaks"] = peaks.to_json()
    write_cache_json(path, data)
