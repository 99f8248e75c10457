"""Practical peaks of this machine, measured with the engines Kiln drives and cached on disk.

The roofline needs the limits a model can actually reach here, not datasheet numbers: the
GFLOP/s of a large GEMM in ONNX Runtime (fp32, and int8 through MatMulInteger, which uses
VNNI/AMX where present), in OpenVINO at bf16 where the CPU has bf16 instructions, and the
memory bandwidth of large array copies. One measurement takes a few seconds (at most ~20 s);
the result is kept under ``$KILN_HOME/hardware/<hardware fingerprint>.json``.
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
_BANDWIDTH_BYTES = 128 << 20  # per array: several times any L3 a 2-64 core CPU has


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

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Peaks:
        """Rebuild from `to_json`; ValueError/TypeError/KeyError on anything malformed."""
        given = {
            f.name: data[f.name] if f.default is MISSING else data.get(f.name, f.default)
            for f in fields(cls)
        }
        peaks = cls(**given)
        numbers = [peaks.fp32_gflops, peaks.bandwidth_gbs, peaks.bf16_gflops, peaks.int8_gops]
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
    _save(path, peaks)
    return peaks


def cache_path() -> Path:
    """Where this machine's peaks are cached: ``$KILN_HOME/hardware/<fingerprint>.json``."""
    return kiln_home() / "hardware" / f"{cpu_info().fingerprint}.json"


def measure(progress: Callable[[str], None] | None = None) -> Peaks:
    """Measure every peak now (no cache)."""
    say = progress or (lambda _step: None)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    threads = cpu_info().physical_cores  # hyper-threads add nothing to a GEMM's throughput
    say("fp32 GEMM (ONNX Runtime)")
    fp32 = _gemm_gflops("fp32", threads)
    if fp32 is None:
        raise KilnError("could not measure the fp32 GEMM peak: ONNX Runtime failed to run it.")
    say("int8 GEMM (ONNX Runtime MatMulInteger)")
    int8 = _gemm_gflops("int8", threads)
    features = set(cpu_info().features)
    bf16 = None
    if features & {"avx512_bf16", "amx_bf16"}:  # elsewhere bf16 is emulated: not a peak
        say("bf16 GEMM (OpenVINO)")
        bf16 = _gemm_gflops("bf16", threads)
    say("memory bandwidth (copy, triad)")
    return Peaks(
        fp32_gflops=round(fp32, 1),
        bf16_gflops=None if bf16 is None else round(bf16, 1),
        int8_gops=None if int8 is None else round(int8, 1),
        bandwidth_gbs=round(_bandwidth_gbs(threads), 2),
        threads=threads,
        measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        load_average=None if load is None else round(load, 2),
    )


# ---------------------------------------------------------------------------- internals
def _gemm_gflops(precision: str, threads: int) -> float | None:
    """GFLOP/s (2 per multiply-accumulate) of an n×n×n MatMul with a constant weight, as a
    real model's layer is (engines pre-pack constant weights); None if the engine fails."""
    from kiln.backends import OpenVinoOptions, OrtOptions, get_backend

    n = 1024 if threads <= 8 else 2048  # big enough to keep every core busy, quick to run
    rng = np.random.default_rng(0)
    if precision == "int8":  # u8 × s8 is the form VNNI and AMX kernels take
        feed = rng.integers(0, 256, (n, n), dtype=np.uint8)
        weight = rng.integers(-128, 128, (n, n), dtype=np.int8)
    else:  # bf16 runs an fp32 model that OpenVINO computes in bf16
        feed = rng.standard_normal((n, n), dtype=np.float32)
        weight = rng.standard_normal((n, n), dtype=np.float32)
    try:
        model = _matmul_model(feed, weight)
        if precision == "bf16":
            backend = get_backend("openvino")
            options = OpenVinoOptions(inference_precision="bf16", inference_num_threads=threads)
            exe = backend.compile(model, options)
            if exe.precision != "bf16":  # OpenVINO fell back to another precision
                return None
        else:
            exe = get_backend("ort").compile(model, OrtOptions(intra_op_threads=threads))
        seconds = _best_seconds(lambda: exe.run({"a": feed}))
    except KilnError:
        return None
    return 2 * n**3 / seconds / 1e9


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
    n = _BANDWIDTH_BYTES // 8
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


def _load(path: Path) -> Peaks | None:
    """The cached peaks, or None when the file is missing, truncated, edited into something
    malformed, or written on another machine: then they are measured again."""
    data = read_cache_json(path)
    if data.get("fingerprint") != cpu_info().fingerprint:
        return None
    try:
        return Peaks.from_json(data["peaks"])
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def _save(path: Path, peaks: Peaks) -> None:
    """Write atomically (no reader sees half a file); an unwritable KILN_HOME costs a
    re-measurement next time, nothing else."""
    data = {"fingerprint": cpu_info().fingerprint, "cpu": cpu_info().to_json()}
    data["peaks"] = peaks.to_json()
    write_cache_json(path, data)
