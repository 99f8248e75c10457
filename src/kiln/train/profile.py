"""The step profiler: where a training step's time and memory go, against this machine's
measured peaks, with the bottlenecks named and the TrainConfig change that addresses each.

    profile = profile_steps(one_step, model=model, precision="bf16", samples_per_step=32)
    findings = diagnose(profile)
    write_report(profile, findings, "report.html")

`one_step` runs one optimizer step of the user's loop, its parts marked with
`kiln.train.phases.phase`. Three kinds of runs, each doing what it measures best:

- timed steps, profiler off: the wall time of each step and of its phases (`phases.recording`),
  so the split and the FLOP/s are the loop's real speed, not the profiler's;
- profiled steps (torch.profiler, shapes, memory and stacks): communication — the collectives'
  own spans (gloo's `gloo:*` on its worker thread, NCCL's `nccl*` kernels) against the compute
  of the same process (aten ops on CPU, other kernels on a GPU), split into exposed and
  overlapped —, the matmuls' dtypes, the optimizer's implementation, and the memory timeline by
  category (torch's MemoryProfileTimeline; allocator totals where it fails);
- one step under FlopCounterMode: the FLOPs the step really runs (forward, backward and
  optimizer as they execute, recomputation included), not a 6·N·tokens estimate.

The parts of a step (data, forward, backward, optimizer, exposed communication, other) add up
to its measured wall time: exposed communication is taken out of the phase it happened in,
and "other" is what no phase covers (logging, the loop's own code).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from kiln.errors import KilnError
from kiln.hardware import Peaks, cpu_info, measured_peaks
from kiln.timing import FASTER, Speedup, interleave, speedup
from kiln.train.config import PRECISIONS, TrainConfig
from kiln.train.phases import PHASES, recording

PARTS = (*PHASES, "communication", "other")  # "communication": exposed collectives only
PART_LABELS = {"communication": "communication (exposed)"}
CATEGORIES = ("parameters", "gradients", "optimizer state", "activations", "other")
MIB = 1 << 20
MAX_POINTS = 1500  # of the memory timeline kept for the report (the peak always among them)

# Collectives, as the profiler names them: gloo runs each on a worker thread as a span named
# "gloo:all_reduce", "gloo:all_gather", "gloo:send", "gloo:recv" ... (its reduce_scatter runs as
# an all_reduce); NCCL's run as GPU kernels "ncclDevKernel_AllReduce_…" / "ncclKernel_…", its
# CPU-side "nccl:all_reduce" being only the enqueue. The "c10d::allreduce_" ops on the main
# thread are the calls that enqueue them: neither communication nor compute.
GLOO = "gloo:"
NCCL = "nccl"
KERNEL_NOT_COMPUTE = ("nccl", "memcpy", "memset")
# The aten ops that are matrix products (their inputs' dtype says which kernels ran).
MATMULS = {
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm",
    "aten::convolution", "aten::convolution_backward",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
    "aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
}  # fmt: skip
DTYPES = {"float": "fp32", "c10::BFloat16": "bf16", "c10::Half": "fp16", "double": "fp64"}
Spans = list[tuple[float, float]]  # (start µs, end µs), sorted and disjoint: a union
BF16_FEATURES = ("amx_bf16", "avx512_bf16")  # CPU instructions with native bf16 dot products


# --------------------------------------------------------------------------- the record
@dataclass
class StepProfile:
    """What `profile_steps` measured. Times are ms per optimizer step; `split_ms` holds the
    mean of each of PARTS over the timed steps and adds up to `step_ms`."""

    device: str
    precision: str
    threads: int  # torch's intra-op threads
    cores: int  # the cores this process may run on
    parameters: int
    steps: list[dict[str, float]]  # per timed step: "step_ms" and each of PARTS
    split_ms: dict[str, float]
    step_ms: float  # mean wall time of a step, profiler off (what throughput divides by)
    step_p50_ms: float
    profiled_step_ms: float  # mean under the profiler: its overhead shows against step_ms
    communication: dict[str, Any]
    matmuls: dict[str, dict[str, float]]  # dtype → calls and ms per profiled step
    optimizer: str | None  # fused | foreach | for-loop (one kernel per tensor) | None
    memory: dict[str, Any]
    flops_per_step: int | None
    achieved_gflops: float | None
    peak_gflops: float | None
    peak_precision: str | None  # whose GEMM peak MFU is measured against
    mfu: float | None
    peak_note: str | None
    peaks: dict[str, float | None] = field(default_factory=dict)  # measured GFLOP/s
    bf16_kernels: list[str] = field(default_factory=list)  # why bf16 is fast here, if it is
    samples_per_step: int | None = None
    tokens_per_step: int | None = None

    def share(self, part: str) -> float:
        """The fraction of the mean step that `part` takes."""
        return self.split_ms[part] / self.step_ms if self.step_ms > 0 else 0.0

    @property
    def samples_per_s(self) -> float | None:
        return _rate(self.samples_per_step, self.step_ms)

    @property
    def tokens_per_s(self) -> float | None:
        return _rate(self.tokens_per_step, self.step_ms)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["samples_per_s"], data["tokens_per_s"] = self.samples_per_s, self.tokens_per_s
        return data


@dataclass
class Finding:
    """A bottleneck: its evidence and the change that addresses it. `settings` are the
    TrainConfig fields to try, dotted ({"loader.workers": 1}); `action` says the same as
    `kiln train` flags or its --config JSON; `changes()` is the form TrainConfig.replace
    takes."""

    kind: str
    title: str
    share: float  # of the step time (memory findings: of the peak memory)
    time_ms: float | None  # per step, where the finding is about time
    evidence: str
    action: str
    settings: dict[str, Any]
    # the advised settings timed against those in use (kiln.timing.Speedup's JSON and
    # "tried": true), or {"tried": false, "why": ...}; None for memory findings
    measured: dict[str, Any] | None = None

    def changes(self) -> dict[str, Any]:
        """{"loader": {"workers": 1}, "precision": "bf16"}: for TrainConfig.replace(**...)
        and for a train.json."""
        return _nested(self.settings)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "changes": self.changes()}


def _nested(settings: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in settings.items():
        section, _, name = key.rpartition(".")
        (out.setdefault(section, {}) if section else out)[name] = value
    return out


def _rate(amount: int | None, step_ms: float) -> float | None:
    return amount * 1e3 / step_ms if amount and step_ms > 0 else None


# --------------------------------------------------------------------------- measuring
def profile_steps(
    run_step: Callable[[], None],
    *,
    model: torch.nn.Module,
    steps: int = 5,
    warmup: int = 2,
    precision: str = "fp32",
    tokens_per_step: int | None = None,
    samples_per_step: int | None = None,
    count_flops: bool = True,
    peaks: Peaks | None = None,
) -> StepProfile:
    """Profile `run_step` (one optimizer step of the caller's loop, phases marked): `warmup`
    steps unmeasured, `steps` timed, `steps` under torch.profiler, and with `count_flops`
    one more under FlopCounterMode. `peaks` (kiln.hardware.Peaks) defaults to this machine's
    measured ones (measured on first use, ~15 s, then cached). Every call trains: the steps
    are real optimizer steps."""
    _check(steps, warmup, precision, tokens_per_step, samples_per_step)
    device = _device_of(model)
    sync = _sync_for(device)
    for _ in range(warmup):
        run_step()
    timed = [_timed_step(run_step, sync) for _ in range(steps)]
    trace = _traced(run_step, steps, sync, device)
    flops = _count_flops(run_step) if count_flops else None
    split = [_split(t, trace["communication"]["by_phase_ms"]) for t in timed]
    step_ms = statistics.fmean(t["step_ms"] for t in split)
    peak, used, note, measured = _peak(precision, device, peaks)
    achieved = flops / step_ms / 1e6 if flops and step_ms > 0 else None
    return StepProfile(
        device=str(device), precision=precision, threads=torch.get_num_threads(),
        cores=_cores(), parameters=sum(p.numel() for p in model.parameters()),
        steps=split, split_ms={part: statistics.fmean(s[part] for s in split) for part in PARTS},
        step_ms=step_ms, step_p50_ms=statistics.median(t["step_ms"] for t in split),
        profiled_step_ms=trace["profiled_step_ms"], communication=trace["communication"],
        matmuls=trace["matmuls"], optimizer=trace["optimizer"], memory=trace["memory"],
        flops_per_step=flops, achieved_gflops=achieved, peak_gflops=peak, peak_precision=used,
        mfu=achieved / peak if achieved and peak else None, peak_note=note, peaks=measured,
        bf16_kernels=_bf16_kernels(device), samples_per_step=samples_per_step,
        tokens_per_step=tokens_per_step,
    )  # fmt: skip


def _check(steps: int, warmup: int, precision: str, *amounts: int | None) -> None:
    if not isinstance(steps, int) or steps < 1 or not isinstance(warmup, int) or warmup < 0:
        raise KilnError(f"steps {steps!r}, warmup {warmup!r}: give steps ≥ 1 and warmup ≥ 0.")
    if precision not in PRECISIONS:
        raise KilnError(f"precision '{precision}': use one of {', '.join(PRECISIONS)}.")
    if any(a is not None and (not isinstance(a, int) or a < 1) for a in amounts):
        raise KilnError("tokens_per_step and samples_per_step are whole numbers ≥ 1 (or None).")


def _device_of(model: torch.nn.Module) -> torch.device:
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    if device.type == "cuda" and device.index is None:  # the memory timeline keys by index
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _sync_for(device: torch.device) -> Callable[[], None] | None:
    """Waiting for a GPU at phase boundaries makes its asynchronous work land in the phase
    that launched it; a CPU's work is done when the call returns."""
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return None


def _cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _timed_step(run_step: Callable[[], None], sync: Callable[[], None] | None) -> dict[str, float]:
    """One step's wall time and each phase's, in ms, the profiler off."""
    with recording(sync) as spans:
        start = time.perf_counter()
        run_step()
        if sync is not None:
            sync()
        end = time.perf_counter()
    out = {"step_ms": (end - start) * 1e3, **dict.fromkeys(PHASES, 0.0)}
    for name, begin, finish in spans.spans:
        out[name] += (finish - begin) * 1e3
    return out


def _split(timed: dict[str, float], exposed: dict[str, float]) -> dict[str, float]:
    """A timed step as PARTS: the exposed communication measured in each phase (the profiled
    steps' mean) moves out of that phase; "other" is the time outside every phase."""
    parts = {"step_ms": timed["step_ms"], "communication": 0.0}
    for name in PHASES:
        moved = min(exposed.get(name, 0.0), timed[name])
        parts[name] = timed[name] - moved
        parts["communication"] += moved
    outside = max(timed["step_ms"] - sum(timed[name] for name in PHASES), 0.0)
    moved = min(exposed.get("other", 0.0), outside)
    parts["communication"] += moved
    parts["other"] = timed["step_ms"] - sum(parts[name] for name in (*PHASES, "communication"))
    return parts


def _count_flops(run_step: Callable[[], None]) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    with counter:
        run_step()
    return int(counter.get_total_flops())


def _peak(
    precision: str, device: torch.device, peaks: Peaks | None
) -> tuple[float | None, str | None, str | None, dict[str, float | None]]:
    """(GFLOP/s MFU is measured against, whose peak it is, a note, the measured peaks)."""
    if device.type != "cpu":
        note = f"kiln.hardware measures this machine's CPU peaks only: no MFU on {device}"
        return None, None, note, {}
    if peaks is None:
        peaks = measured_peaks()
    measured = {"fp32": peaks.fp32_gflops, "bf16": peaks.bf16_gflops}
    if precision == "bf16" and peaks.bf16_gflops:
        return peaks.bf16_gflops, "bf16", None, measured
    note = {
        "bf16": "no bf16 GEMM kernels measured on this CPU: MFU against the fp32 peak",
        "fp16": "fp16 has no measured peak here (CPUs compute it through fp32 or emulate "
        "it): MFU against the fp32 peak",
    }.get(precision)
    return peaks.fp32_gflops, "fp32", note, measured


def _bf16_kernels(device: torch.device) -> list[str]:
    if device.type == "cuda":
        supported = torch.cuda.is_bf16_supported(including_emulation=False)
        return [f"{torch.cuda.get_device_name(device)} (bf16 tensor cores)"] * supported
    return [f for f in cpu_info().features if f in BF16_FEATURES]


# --------------------------------------------------------------------------- the profiled steps
class _Event(NamedTuple):
    name: str
    start: float  # µs, the profiler's clock (the memory timeline's too)
    end: float
    thread: int
    device: bool  # a GPU kernel (or copy), not a CPU op
    dtypes: tuple[str, ...]


def _traced(
    run_step: Callable[[], None], steps: int, sync: Callable[[], None] | None, device: torch.device
) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (device.type == "cuda")
    # stacks and shapes are what the memory profiler needs to tell activations from the rest
    prof = profile(activities=activities, record_shapes=True, profile_memory=True,
                   with_stack=True)  # fmt: skip
    with _native_stderr_muted():
        prof.start()
    try:
        for _ in range(steps):
            with recording(sync), record_function("kiln.step"):
                run_step()
                if sync is not None:
                    sync()
    finally:
        with _native_stderr_muted():
            prof.stop()
    events = _events(prof)
    windows = _windows(events)
    origin = windows[0]["step"][0][0] if windows else 0.0
    return {
        "profiled_step_ms": statistics.fmean(_total(w["step"]) for w in windows) / 1e3
        if windows
        else 0.0,
        "communication": _communication(events, windows),
        "matmuls": _matmuls(events, windows),
        "optimizer": _optimizer(events, windows),
        "memory": _memory(prof, device, origin, [w["step"][0][0] for w in windows]),
    }


@contextlib.contextmanager
def _native_stderr_muted() -> Iterator[None]:
    """The process's stderr closed for one call: libkineto writes "USDT: … profiler_start"
    and "… profiler_stop" lines from C++ at each start and stop, noise in the user's output.
    Only the start and the stop are muted, never the user's steps."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _events(prof: Any) -> list[_Event]:
    """The profiler's events, Python frames and memory records left out. Read from the
    kineto results, as torch's memory profiler does, so both share one clock."""
    out = []
    cpu = torch.autograd.DeviceType.CPU
    for event in prof.profiler.kineto_results.events():
        name = event.name()
        if event.is_python_function() or name.startswith("["):
            continue
        start = event.start_ns() / 1e3
        out.append(_Event(name, start, start + event.duration_ns() / 1e3,
                          event.start_thread_id(), event.device_type() != cpu,
                          tuple(event.dtypes())))  # fmt: skip
    return out


def _windows(events: list[_Event]) -> list[dict[str, Spans]]:
    """Per profiled step: its span ("step") and the spans of each phase inside it."""
    steps = sorted((e.start, e.end) for e in events if e.name == "kiln.step")
    windows = []
    for start, end in steps:
        window: dict[str, Spans] = {"step": [(start, end)]}
        for name in PHASES:
            window[name] = _union(
                (e.start, e.end)
                for e in events
                if e.name == f"kiln.{name}" and start <= e.start and e.end <= end
            )
        windows.append(window)
    return windows


def _communication(events: list[_Event], windows: list[dict]) -> dict[str, Any]:
    """Collectives' time per step, exposed (no compute of this process at the same moment)
    and overlapped, and where the exposed part fell (which phase, or "other")."""
    comm = _comm_events(events)
    compute = _union((e.start, e.end) for e in _compute_events(events, comm))
    busy = _union((e.start, e.end) for e in comm)
    exposed = _subtract(busy, compute)
    per_step: list[dict[str, float]] = []
    for window in windows:
        step_exposed = _overlap(exposed, window["step"])
        row = {name: _total(_overlap(step_exposed, window[name])) / 1e3 for name in PHASES}
        row["other"] = _total(step_exposed) / 1e3 - sum(row.values())
        row["exposed"] = _total(step_exposed) / 1e3
        row["busy"] = _total(_overlap(busy, window["step"])) / 1e3
        per_step.append(row)
    mean = {k: statistics.fmean(r[k] for r in per_step) if per_step else 0.0
            for k in (*PHASES, "other", "exposed", "busy")}  # fmt: skip
    # counted where they start: a worker thread's span may end a little past its step
    steps = [w["step"][0] for w in windows]
    names = Counter(e.name for e in comm if any(s <= e.start < t for s, t in steps))
    return {
        "exposed_ms": mean["exposed"],
        "overlapped_ms": mean["busy"] - mean["exposed"],
        "by_phase_ms": {k: mean[k] for k in (*PHASES, "other")},
        "collectives": {name: count / max(len(windows), 1) for name, count in names.items()},
    }


def _comm_events(events: list[_Event]) -> list[_Event]:
    return [
        e
        for e in events
        if (e.device and e.name.lower().startswith(NCCL))
        or (not e.device and e.name.startswith(GLOO))
    ]


def _compute_events(events: list[_Event], comm: list[_Event]) -> list[_Event]:
    """A GPU's kernels where there are any (its CPU ops are launches); otherwise the aten ops
    of every thread that runs no collective (a gloo thread's copies are the collective's)."""
    if any(e.device for e in events):
        return [e for e in events if e.device and not e.name.lower().startswith(KERNEL_NOT_COMPUTE)]
    comm_threads = {e.thread for e in comm}
    # aten ops only: wrappers (nn.Module, Optimizer.step, kiln.*) and the c10d:: calls that
    # enqueue collectives span the waits too
    return [
        e
        for e in events
        if e.name.startswith("aten::") and "wait" not in e.name and e.thread not in comm_threads
    ]


def _matmuls(events: list[_Event], windows: list[dict]) -> dict[str, dict[str, float]]:
    """Per dtype: the matrix products' calls and CPU time per profiled step (on a GPU the
    time is the launches': only the calls say anything there)."""
    steps = max(len(windows), 1)
    inside = [e for e in events if e.name in MATMULS and not e.device
              and any(_inside(e, w["step"]) for w in windows)]  # fmt: skip
    out: dict[str, dict[str, float]] = {}
    for dtype in sorted({_dtype(e) for e in inside}):
        chosen = [e for e in inside if _dtype(e) == dtype]
        out[dtype] = {
            "calls": len(chosen) / steps,
            "ms": _total(_union((e.start, e.end) for e in chosen)) / 1e3 / steps,
        }
    return out


def _dtype(event: _Event) -> str:
    first = next((d for d in event.dtypes if d), "")
    return DTYPES.get(first, first or "unknown")


def _optimizer(events: list[_Event], windows: list[dict]) -> str | None:
    """How the optimizer step ran: fused kernels, foreach (one op per group of tensors), or a
    for-loop (several ops per parameter tensor)."""
    spans = [s for w in windows for s in w["optimizer"]]
    names = {e.name for e in events if not e.device and _inside(e, spans)}
    if any("_fused_" in n for n in names):
        return "fused"
    if any("_foreach_" in n for n in names):
        return "foreach"
    return "for-loop" if any(n.startswith("aten::") for n in names) else None


# ----------------------------------------------------------------- intervals (µs, sorted)
def _union(spans: Iterable[tuple[float, float]]) -> Spans:
    merged: Spans = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        elif end > start:
            merged.append((start, end))
    return merged


def _overlap(a: Spans, b: Spans) -> Spans:
    """The intersection of two unions."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _subtract(a: Spans, b: Spans) -> Spans:
    """The parts of union `a` outside union `b`, in one pass over both."""
    out, first = [], 0
    for start, end in a:
        while first < len(b) and b[first][1] <= start:  # cuts behind this span and the rest
            first += 1
        cursor, k = start, first
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cursor:
                out.append((cursor, b[k][0]))
            cursor = max(cursor, b[k][1])
            k += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def _total(spans: Spans) -> float:
    return sum(end - start for start, end in spans)


def _inside(event: _Event, spans: Spans) -> bool:
    return any(start <= event.start and event.end <= end for start, end in spans)


# --------------------------------------------------------------------------- memory
# torch's categories → the report's (inputs, temporaries and autograd's own buffers are "other")
_TORCH_CATEGORIES = {
    "PARAMETER": "parameters",
    "GRADIENT": "gradients",
    "OPTIMIZER_STATE": "optimizer state",
    "ACTIVATION": "activations",
}


def _memory(prof: Any, device: torch.device, origin: float, marks: list[float]) -> dict[str, Any]:
    """The memory timeline by category (ms from the first profiled step, MiB), its peak and
    what it held at the peak. torch's categorisation is a private API: on any failure the
    allocator's running total (uncategorised) stands in, and the note says why."""
    try:
        times, columns = _categorised(prof, device)
        source, note = "categories", None
    except Exception as exc:  # noqa: BLE001 - a private API's failure must not lose the profile
        times, columns = _allocated(prof, device)
        source = "allocator"
        note = (f"memory categories unavailable ({type(exc).__name__}: {exc}); allocations made "
                "while profiling, uncategorised")  # fmt: skip
    return _timeline(times, columns, origin, marks) | {
        "source": source, "device": str(device), "note": note, "device_mib": _device_mib(device),
    }  # fmt: skip


def _device_mib(device: torch.device) -> float:
    """All the memory of the device: the GPU's, or the machine's for a CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / MIB
    import psutil

    return psutil.virtual_memory().total / MIB


def _categorised(prof: Any, device: torch.device) -> tuple[list[float], dict[str, list[float]]]:
    from torch.profiler._memory_profiler import _CATEGORY_TO_INDEX, MemoryProfileTimeline

    times, sizes = MemoryProfileTimeline(prof._memory_profile())._coalesce_timeline(str(device))
    if not times:
        raise ValueError(f"no allocations on {device}")
    columns: dict[str, list[float]] = {name: [0.0] * len(times) for name in CATEGORIES}
    for category, index in _CATEGORY_TO_INDEX.items():
        name = _TORCH_CATEGORIES.get(getattr(category, "name", ""), "other")
        column = columns[name]
        for row, values in enumerate(sizes):
            column[row] += values[index + 1] / MIB  # slot 0 of each row is unused
    return [float(t) for t in times], columns


def _allocated(prof: Any, device: torch.device) -> tuple[list[float], dict[str, list[float]]]:
    cpu = device.type == "cpu"
    records = sorted(
        (e.start_ns() / 1e3, e.nbytes())
        for e in prof.profiler.kineto_results.events()
        if e.name() == "[memory]" and (e.device_type() == torch.autograd.DeviceType.CPU) == cpu
    )
    total, times, column = 0.0, [], []
    for at, change in records:
        total += change / MIB
        times.append(at)
        column.append(total)
    return times, {name: column if name == "other" else [0.0] * len(column) for name in CATEGORIES}


def _timeline(
    times: list[float], columns: dict[str, list[float]], origin: float, marks: list[float]
) -> dict[str, Any]:
    totals = [sum(columns[name][i] for name in CATEGORIES) for i in range(len(times))]
    if not totals:
        return {"t_ms": [], "mib": {}, "peak_mib": 0.0, "peak_t_ms": None, "at_peak_mib": {},
                "steps_ms": []}  # fmt: skip
    peak = max(range(len(totals)), key=totals.__getitem__)
    keep = _thin(totals, MAX_POINTS)
    return {
        "t_ms": [(times[i] - origin) / 1e3 for i in keep],
        "mib": {name: [columns[name][i] for i in keep] for name in CATEGORIES},
        "peak_mib": totals[peak],
        "peak_t_ms": (times[peak] - origin) / 1e3,
        "at_peak_mib": {name: columns[name][peak] for name in CATEGORIES},
        "steps_ms": [(mark - origin) / 1e3 for mark in marks],
    }


def _thin(totals: list[float], most: int) -> list[int]:
    """Indices of at most ~`most` points: the highest of each run of neighbours, so the
    peaks survive the thinning."""
    if len(totals) <= most:
        return list(range(len(totals)))
    size = math.ceil(len(totals) / most)
    return [max(range(i, min(i + size, len(totals))), key=totals.__getitem__)
            for i in range(0, len(totals), size)]  # fmt: skip


# --------------------------------------------------------------------------- diagnosis
DATA_BOUND = 0.20  # of the step waiting for the next batch
EXPOSED_COMM = 0.10  # of the step in collectives no compute hides
FP32_MATMULS = 0.20  # of the (profiled) step in fp32 matrix products
OPTIMIZER_BOUND = 0.25  # of the step in the optimizer
ACTIVATIONS = 0.50  # of the peak memory held by activations
# Of the device's memory: below this share memory limits neither the batch nor the model, and
# trading compute for memory (checkpointing) only slows the step.
MEMORY_TIGHT = 0.50
UNEVEN = 1.5  # slowest batch over the mean: prefetch more to ride out the slow ones
# TrainConfig fields that `kiln train` takes as flags; the rest go in its --config JSON
CLI_FLAGS = {"precision": "--precision", "checkpointing.policy": "--checkpointing"}


def diagnose(profile: StepProfile, config: TrainConfig | None = None) -> list[Finding]:
    """The bottlenecks of a profile: those of time, largest share of the step first, then
    those of memory (a share of the peak is not a share of the step). `config` (the run's
    TrainConfig) lets the advice start from the settings in use; without it, the defaults."""
    base = config or TrainConfig()
    rules = (_data_bound, _exposed_comm, _fp32_matmuls, _optimizer_bound, _activations)
    found = [f for rule in rules if (f := rule(profile, base)) is not None]
    return sorted(found, key=lambda f: (f.time_ms is None, -f.share))


def _finding(kind: str, title: str, share: float, time_ms: float | None, evidence: str,
             fix: str, settings: dict[str, Any]) -> Finding:  # fmt: skip
    action = f"{fix}: {_how(settings)}"
    return Finding(kind, title, share, time_ms, evidence, action, settings)


def _how(settings: dict[str, Any]) -> str:
    """The settings as `kiln train` flags where it has them, the rest as its --config JSON."""
    flags = " ".join(f"{CLI_FLAGS[k]} {v}" for k, v in settings.items() if k in CLI_FLAGS)
    rest = {k: v for k, v in settings.items() if k not in CLI_FLAGS}
    config = f"--config with {json.dumps(_nested(rest))}" if rest else ""
    return " ".join(part for part in ("kiln train …", flags, config) if part)


def _data_bound(p: StepProfile, base: TrainConfig) -> Finding | None:
    share = p.share("data")
    if share < DATA_BOUND:
        return None
    data, rest = p.split_ms["data"], max(p.step_ms - p.split_ms["data"], 1e-3)
    now = base.loader.workers
    # a batch's making: the wait itself in-process; with N workers keeping the step waiting,
    # N batches per step's time
    making = data if now == 0 else now * p.step_ms
    needed = math.ceil(making / rest)  # workers that keep pace with the rest of the step
    spare = max(p.cores - 1, 1)  # one core stays with the training process
    workers = max(min(needed, spare), 1, now)  # never fewer than now
    slowest = max(s["data"] for s in p.steps)
    prefetch = 4 if slowest > UNEVEN * data else 2  # uneven batches: more in flight
    evidence = (
        f"the step waits {data:.1f} ms for its batch ({share:.0%} of {p.step_ms:.1f} ms); "
        f"loading runs in {_in_workers(now)}; the slowest batch took {slowest:.1f} ms"
    )
    fix = (
        f"load batches in {workers} worker process{'es' * (workers > 1)} while the step "
        f"computes ({p.cores} cores: cores − 1 = {spare}), {prefetch} batches ahead each"
    )
    if needed > workers:
        fix += (f"; keeping pace needs ~{needed} workers, more than the cores spare: make "
                "__getitem__ cheaper too (decode or tokenize once, ahead of training)")  # fmt: skip
    settings = {"loader.workers": workers, "loader.prefetch_factor": prefetch}
    return _finding("data-bound", "data-bound: the step waits for batches", share, data,
                    evidence, fix, settings)  # fmt: skip


def _in_workers(workers: int) -> str:
    return "the training process (loader.workers 0)" if workers == 0 else f"{workers} workers"


def _exposed_comm(p: StepProfile, base: TrainConfig) -> Finding | None:
    comm = p.communication
    share = p.share("communication")
    if share < EXPOSED_COMM:
        return None
    where = max(comm["by_phase_ms"], key=comm["by_phase_ms"].get)
    names = ", ".join(sorted(comm["collectives"])) or "collectives"
    evidence = (
        f"{p.split_ms['communication']:.1f} ms per step ({share:.0%}) in {names} with no "
        f"compute beside it, mostly in {where}; {comm['overlapped_ms']:.1f} ms overlapped (a "
        "wait for a slower rank counts as exposed too)"
    )
    if base.parallel.strategy == "pipeline":
        # Stages wait on each other's sends for (stages − 1) of (microbatches + stages − 1)
        # slots of a GPipe-style schedule: more microbatches shrink that bubble.
        now = base.parallel.microbatches
        more = next((n for n in range(now + 1, base.micro_batch + 1) if base.micro_batch % n == 0),
                    None)  # fmt: skip
        settings: dict[str, Any] = {"parallel.microbatches": more} if more else {}
        fix = (f"more microbatches ({more}, now {now}) shrink the schedule's bubble, where a "
               "stage waits on its neighbour's sends" if more else
               f"a larger micro-batch, cut into more than {now} microbatches, shrinks the "
               "schedule's bubble, where a stage waits on its neighbour's sends")  # fmt: skip
    elif base.parallel.strategy == "fsdp2":
        settings = {"parallel.reduce_dtype": "bf16"}
        fix = "reduce-scatter gradients in bf16 (half the bytes)"
    else:
        bucket = max(round(base.parallel.bucket_mb / 2, 1), 1.0)
        settings = {"parallel.bucket_mb": bucket, "parallel.comm_hook": "bf16"}
        fix = (f"smaller gradient buckets ({bucket:g} MB, now {base.parallel.bucket_mb:g}) start "
               "their all-reduce earlier in backward; a bf16 hook halves the bytes")  # fmt: skip
    return _finding("exposed-communication", "exposed communication", share,
                    p.split_ms["communication"], evidence, fix, settings)  # fmt: skip


def _fp32_matmuls(p: StepProfile, base: TrainConfig) -> Finding | None:
    fp32 = p.matmuls.get("fp32")
    if p.precision != "fp32" or not p.bf16_kernels or not fp32 or p.profiled_step_ms <= 0:
        return None
    on_cpu = p.device == "cpu"
    calls = sum(m["calls"] for m in p.matmuls.values()) or 1
    share = fp32["ms"] / p.profiled_step_ms if on_cpu else fp32["calls"] / calls
    if share < FP32_MATMULS:
        return None
    spent = (f"{fp32['ms']:.1f} ms of a {p.profiled_step_ms:.1f} ms profiled step ({share:.0%})"
             if on_cpu else f"{share:.0%} of the matmul calls")  # fmt: skip
    evidence = f"{fp32['calls']:.0f} fp32 matmuls per step take {spent}; this machine has " + (
        f"bf16 kernels ({', '.join(p.bf16_kernels)})"
    )
    if p.peaks.get("bf16"):
        evidence += f": bf16 GEMM peak {p.peaks['bf16']:.0f} vs fp32 {p.peaks['fp32']:.0f} GFLOP/s"
    time_ms = share * p.step_ms
    return _finding("fp32-matmuls", "fp32 matmuls where bf16 kernels exist", share, time_ms,
                    evidence, "autocast the matmuls to bf16", {"precision": "bf16"})  # fmt: skip


def _optimizer_bound(p: StepProfile, base: TrainConfig) -> Finding | None:
    share = p.share("optimizer")
    if share < OPTIMIZER_BOUND or p.optimizer == "fused":
        return None
    how = {"foreach": "foreach (a few ops per group of tensors)",
           "for-loop": "a for-loop (several ops per parameter tensor)"}  # fmt: skip
    evidence = (f"the optimizer takes {p.split_ms['optimizer']:.1f} ms ({share:.0%} of the "
                f"step), run as {how.get(p.optimizer or '', 'unknown ops')}")  # fmt: skip
    fix = (
        "one fused kernel over all parameters (Adam, AdamW, SGD, Adagrad; for others foreach: true)"
    )
    return _finding("optimizer-bound", "optimizer-bound", share, p.split_ms["optimizer"],
                    evidence, fix, {"fused": True, "foreach": None})  # fmt: skip


def _activations(p: StepProfile, base: TrainConfig) -> Finding | None:
    memory = p.memory
    if memory.get("source") != "categories" or not memory.get("peak_mib"):
        return None
    held = memory["at_peak_mib"]
    share = held["activations"] / memory["peak_mib"]
    tight = memory["peak_mib"] >= MEMORY_TIGHT * memory["device_mib"]
    if not tight or share < ACTIVATIONS or base.checkpointing.policy == "full":
        return None
    others = ", ".join(f"{k} {v:.0f}" for k, v in held.items() if k != "activations")
    evidence = (f"activations hold {held['activations']:.0f} MiB of the {memory['peak_mib']:.0f} "
                f"MiB peak ({share:.0%}; {others} MiB); the peak is "
                f"{memory['peak_mib'] / memory['device_mib']:.1%} of the {memory['device']}'s "
                f"{memory['device_mib'] / 1024:.0f} GiB")  # fmt: skip
    fix = (
        "where memory limits the batch or the model: recompute activations in backward "
        "instead of keeping them (about one more forward per step; policy every for half "
        "the saving at half the cost)"
    )
    return _finding("memory-activations", "activations dominate the peak memory", share, None,
                    evidence, fix, {"checkpointing.policy": "full"})  # fmt: skip


# --------------------------------------------------------------------------- trying the advice
AB_ROUNDS = 3  # alternating blocks a side: the fewest kiln.timing gives a verdict on
AB_STEPS = 2  # timed steps a block, after one untimed (the other side's threads and caches)
UNTRIED = "it needs another run to try; kiln train --tune measures it"


def try_advice(
    findings: list[Finding],
    run_step: Callable[[], None],
    advised_step: Callable[[dict[str, Any]], Callable[[], None] | None],
    model: torch.nn.Module,
) -> list[Finding]:
    """Each speed finding's advice timed against the settings in use, in alternating blocks
    of real steps (kiln.timing: interleaved rounds, the ratio of P50s, a verdict only when
    every round agrees). A peak ratio is not a speedup: bf16 kernels twice as fast in a GEMM
    can lose to autocast's casts in a small model's step. `advised_step(changes)` is
    `run_step` under the finding's changes, or None where this run cannot switch to them (a
    loader, a communication hook, another optimizer): that finding says it is untested.
    Advice measured not faster is withdrawn; its evidence stays. Every call trains."""
    sync = _sync_for(_device_of(model))

    def timed(step: Callable[[], None]) -> Callable[[], None]:
        return step if sync is None else lambda: (step(), sync())[-1]

    for finding in (f for f in findings if f.time_ms is not None):
        step = advised_step(finding.changes())
        if step is None:
            finding.measured = {"tried": False, "why": UNTRIED}
            finding.action += f" (untested: {UNTRIED})"
            continue
        runners = {"now": timed(run_step), "advised": timed(step)}
        samples = interleave(runners, rounds=AB_ROUNDS, runs=AB_STEPS, warmup=1)
        _judge(finding, speedup(samples["now"], samples["advised"]))
    return sorted(findings, key=_advice_first)


def _judge(finding: Finding, measured: Speedup) -> None:
    finding.measured = {"tried": True, **measured.to_json()}
    low, high = measured.spread or (measured.value, measured.value)
    figures = f"{measured.value:.2f}× ({low:.2f}–{high:.2f}, {measured.verdict})"
    if measured.verdict == FASTER:
        finding.action += f" — measured here {figures}"
    else:
        finding.action = (
            f"keep the settings in use: {_how(finding.settings)} measured {figures} against "
            "them in alternating blocks of this run's steps"
        )


def _advice_first(finding: Finding) -> tuple[bool, bool, float]:
    withdrawn = bool(finding.measured and finding.measured.get("verdict") not in (None, FASTER))
    return withdrawn, finding.time_ms is None, -finding.share


# --------------------------------------------------------------------------- the report
COLORS = {
    "data": "#e4a11b", "forward": "#4c78a8", "backward": "#72b7b2", "optimizer": "#54a24b",
    "communication": "#e45756", "other": "#bab0ac",
    "parameters": "#2f6b2f", "gradients": "#3b5bdb", "optimizer state": "#c9a227",
    "activations": "#d9480f",
}  # fmt: skip
_CONFIG = {"displaylogo": False, "responsive": True}
_LAYOUT = {"margin": {"l": 60, "r": 20, "t": 40, "b": 50}, "template": "plotly_white"}


def write_report(profile: StepProfile, findings: list[Finding], path: str | os.PathLike) -> Path:
    """The self-contained HTML report (plotly embedded, nothing fetched), written atomically."""
    from kiln.home import atomic_write_text

    path = Path(path)
    atomic_write_text(path, render_report(profile, findings))
    return path


def render_report(profile: StepProfile, findings: list[Finding]) -> str:
    import jinja2
    import plotly.offline

    environment = jinja2.Environment(
        loader=jinja2.FileSystemLoader(Path(__file__).parent),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
    )
    template = environment.get_template("profile.html.j2")
    return template.render(
        p=profile.to_json(), findings=[f.to_json() for f in findings], parts=PARTS,
        labels={part: PART_LABELS.get(part, part) for part in PARTS},
        plotly_js=plotly.offline.get_plotlyjs(),
        split=_div(_split_figure(profile), "split"),
        compute=_div(_compute_figure(profile), "compute") if profile.achieved_gflops else "",
        memory=_div(_memory_figure(profile.memory), "memory") if profile.memory["t_ms"] else "",
    )  # fmt: skip


def _div(figure: Any, div_id: str) -> str:
    return figure.to_html(full_html=False, include_plotlyjs=False, div_id=div_id, config=_CONFIG)


def _split_figure(profile: StepProfile) -> Any:
    """One stacked bar per timed step: its parts, adding up to its wall time."""
    import plotly.graph_objects as go

    numbers = list(range(1, len(profile.steps) + 1))
    figure = go.Figure()
    for part in PARTS:
        figure.add_trace(go.Bar(
            x=numbers, y=[s[part] for s in profile.steps], name=PART_LABELS.get(part, part),
            marker_color=COLORS[part], hovertemplate="%{y:.2f} ms<extra>" + part + "</extra>",
        ))  # fmt: skip
    figure.update_layout(title="each step's wall time, by part (ms)", barmode="stack",
                         xaxis={"title": "timed step", "dtick": 1}, yaxis={"title": "ms"},
                         height=380, **_LAYOUT)  # fmt: skip
    return figure


def _compute_figure(profile: StepProfile) -> Any:
    """Achieved GFLOP/s beside the measured peak it is a fraction of."""
    import plotly.graph_objects as go

    bars = {"achieved": profile.achieved_gflops}
    if profile.peak_gflops:
        bars[f"{profile.peak_precision} peak (measured)"] = profile.peak_gflops
    figure = go.Figure(go.Bar(
        x=list(bars.values()), y=list(bars), orientation="h",
        marker_color=["#4c78a8", "#bab0ac"][: len(bars)],
        text=[f"{v:.1f} GFLOP/s" for v in bars.values()], textposition="auto",
    ))  # fmt: skip
    title = "achieved GFLOP/s" + (f" · MFU {profile.mfu:.1%}" if profile.mfu else "")
    figure.update_layout(title=title, xaxis={"title": "GFLOP/s"}, height=220, **_LAYOUT)
    return figure


def _memory_figure(memory: dict[str, Any]) -> Any:
    """Memory over the profiled steps, stacked by category, the steps' starts marked."""
    import plotly.graph_objects as go

    figure = go.Figure()
    for name in CATEGORIES:
        if any(memory["mib"][name]):
            figure.add_trace(go.Scatter(
                x=memory["t_ms"], y=memory["mib"][name], name=name, stackgroup="memory",
                mode="lines", line={"width": 0.5, "color": COLORS.get(name, "#bab0ac")},
            ))  # fmt: skip
    for index, mark in enumerate(memory["steps_ms"], 1):
        figure.add_vline(x=mark, line={"width": 1, "dash": "dot", "color": "#999"})
        figure.add_annotation(x=mark, y=1, yref="paper", text=f"step {index}",
                              showarrow=False, xanchor="left", font={"size": 9})  # fmt: skip
    figure.update_layout(title=f"memory on {memory['device']} by category (MiB)",
                         xaxis={"title": "ms from the first profiled step"},
                         yaxis={"title": "MiB"}, height=380, **_LAYOUT)  # fmt: skip
    return figure


def print_profile(profile: StepProfile, findings: list[Finding], console: Any) -> None:
    """The terminal view (`kiln train --profile`): the split, the FLOP/s and MFU, memory,
    the findings with their fixes."""
    from rich.markup import escape
    from rich.table import Table

    console.print(_headline(profile))
    split = Table(title="one step, by part")
    split.add_column("part")
    split.add_column("ms/step", justify="right")
    split.add_column("share", justify="right")
    for part in PARTS:
        split.add_row(PART_LABELS.get(part, part), f"{profile.split_ms[part]:.2f}",
                      f"{profile.share(part):.1%}")  # fmt: skip
    split.add_row("[bold]step[/bold]", f"[bold]{profile.step_ms:.2f}[/bold]", "100%")
    split.add_row("MFU", "", _mfu_text(profile))
    console.print(split)
    table = Table(title="bottlenecks", show_lines=True)
    for column in ("bottleneck", "share", "evidence", "fix"):
        table.add_column(column, overflow="fold")
    for finding in findings:
        table.add_row(escape(finding.title), f"{finding.share:.0%}", escape(finding.evidence),
                      escape(finding.action))  # fmt: skip
    console.print(table if findings else "no bottleneck found above the thresholds")


def _headline(p: StepProfile) -> str:
    rate = [f"{r:.1f} {u}/s" for r, u in ((p.samples_per_s, "samples"),
                                           (p.tokens_per_s, "tokens")) if r]  # fmt: skip
    flops = f" · {p.achieved_gflops:.1f} GFLOP/s" if p.achieved_gflops else ""
    return (
        f"{p.device}, {p.precision}, {p.threads} threads: step {p.step_ms:.2f} ms mean "
        f"(P50 {p.step_p50_ms:.2f}; {p.profiled_step_ms:.2f} under the profiler)"
        + (f" · {', '.join(rate)}" if rate else "")
        + flops
        + f" · peak memory {p.memory.get('peak_mib', 0):.0f} MiB"
        + (f"\n{p.peak_note}" if p.peak_note else "")
    )


def _mfu_text(p: StepProfile) -> str:
    if p.mfu is None:
        return "n/a"
    return f"{p.mfu:.1%} of the {p.peak_precision} peak {p.peak_gflops:.0f} GFLOP/s"
