"""`profile_steps`: a user's optimizer step timed with the profiler off (the wall time of the
step and of each phase), traced under torch.profiler (kiln.train.profiling.trace), and run once
under FlopCounterMode; the split of the step, its FLOP/s and the MFU against this machine's
measured peak."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch

from kiln.errors import KilnError
from kiln.hardware import Peaks, cpu_info, measured_peaks
from kiln.train.config import PRECISIONS
from kiln.train.phases import PHASES, recording
from kiln.train.profiling.record import PARTS, StepProfile
from kiln.train.profiling.trace import traced

BF16_FEATURES = ("amx_bf16", "avx512_bf16")  # CPU instructions with native bf16 dot products


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
    device = device_of(model)
    sync = sync_for(device)
    for _ in range(warmup):
        run_step()
    timed = [_timed_step(run_step, sync) for _ in range(steps)]
    trace = traced(run_step, steps, sync, device)
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


def device_of(model: torch.nn.Module) -> torch.device:
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    if device.type == "cuda" and device.index is None:  # the memory timeline keys by index
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def sync_for(device: torch.device) -> Callable[[], None] | None:
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
