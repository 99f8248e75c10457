"""The profiled steps: torch.profiler's events read on one clock, and the arithmetic of their
spans — communication exposed or overlapped by compute, the phase it fell in, the matmuls'
dtypes, how the optimizer ran — with the memory timeline (kiln.train.profiling.memory)."""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch

from kiln.train.phases import PHASES, recording
from kiln.train.profiling.memory import memory_timeline

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


class _Event(NamedTuple):
    name: str
    start: float  # µs, the profiler's clock (the memory timeline's too)
    end: float
    thread: int
    device: bool  # a GPU kernel (or copy), not a CPU op
    dtypes: tuple[str, ...]


def traced(
    run_step: Callable[[], None], steps: int, sync: Callable[[], None] | None, device: torch.device
) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (device.type == "cuda")
    # stacks and shapes are what the memory profiler needs to tell activations from the rest
    prof = profile(activities=activities, record_shapes=True, profile_memory=True,
                   with_stack=True)  # fmt: skip
    with _native_stderr_muted():
        # c10's CPU allocator warns on stderr ("[W … CPUAllocator.cpp] Memory block of unknown
        # size was allocated before the profiling started") at the first free, under the
        # memory profiler, of a block allocated before it started, then at every 1000th.
        # Every step frees such blocks (the last step's gradients, a batch loaded ahead),
        # once per rank: one freed here, stderr muted, spends that warning unseen.
        allocated_before = torch.empty(1)
        prof.start()
        del allocated_before
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
        "memory": memory_timeline(prof, device, origin, [w["step"][0][0] for w in windows]),
    }


@contextlib.contextmanager
def _native_stderr_muted() -> Iterator[None]:
    """The process's stderr closed for one call: libkineto writes "USDT: … profiler_start"
    and "… profiler_stop" lines from C++ at each start and stop, noise in the user's output.
    Only the start and the stop are muted (on every rank), never the user's steps."""
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
