"""Running the model: end-to-end latency without the profiler, per-node records with it.

The machine is shared and noisy, so timing and profiling alternate in rounds: a slow minute
then lands on both, and the per-node sum stays comparable to the end-to-end latency.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import psutil

from kiln.backends.base import KernelRecord
from kiln.profile.memory import RssSampler
from kiln.profile.target import Target

MIN_CPU_WALL_S = 1.0


@dataclass
class Measurement:
    latency_s: list[float]  # end-to-end, one per timed run
    records: list[KernelRecord]  # per-kernel records; `run` numbers every profiled run
    # process CPU time / (wall time × usable cores) while timing; None when the timing was too
    # short for the operating system's CPU-time clock (10 ms ticks) to say
    cpu_utilization: float | None
    cores: int
    # share of all cores' time that nobody (neither we nor other processes) used while timing
    idle_fraction: float | None
    memory: dict[str, Any]  # RSS samples and the figures around compile and first run
    profiled_ms: list[float]  # wall time of each profiled run where the engine reports it


def measure(
    target: Target,
    feeds: dict[str, np.ndarray],
    runs: int = 20,
    rounds: int = 5,
    warmup: int = 3,
    say: Callable[[str], None] = lambda _msg: None,
) -> Measurement:
    from kiln.backends import get_backend

    per_round = max(1, math.ceil(runs / rounds))
    process = psutil.Process()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    latency: list[float] = []
    records: list[KernelRecord] = []
    profiled_ms: list[float] = []
    cpu_s = wall_s = idle_s = machine_s = 0.0
    model_peak = 0.0
    with RssSampler() as rss:
        before = rss.mark("compile")
        say(f"compiling {target.name} for {target.backend}")
        exe = get_backend(target.backend).compile(target.runnable, target.options)
        compiled = rss.mark("first run")
        exe.run(feeds)
        first_run = rss.mark("warm-up")
        for _ in range(warmup):
            exe.run(feeds)
        for index in range(rounds):
            say(f"round {index + 1}/{rounds}: timing {per_round} runs")
            rss.mark(f"timing {index + 1}")
            cpu, machine = process.cpu_times(), psutil.cpu_times()
            for _ in range(per_round):
                start = time.perf_counter()
                exe.run(feeds)
                latency.append(time.perf_counter() - start)
            used, machine_after = process.cpu_times(), psutil.cpu_times()
            cpu_s += (used.user - cpu.user) + (used.system - cpu.system)
            idle_s += _idle(machine_after) - _idle(machine)
            machine_s += sum(machine_after) - sum(machine)
            wall_s += sum(latency[-per_round:])
            if index == 0:
                # Each profiling round opens a session of its own, and freed memory is not
                # always returned to the system: the model's own peak is the one before.
                model_peak = rss.peak_mib()
            say(f"round {index + 1}/{rounds}: profiling {per_round} runs")
            rss.mark(f"profiling {index + 1}")
            offset = index * per_round
            profile = exe.profile(feeds, per_round)
            records += [replace(r, run=r.run + offset) for r in profile.records]
            profiled_ms += profile.run_ms
        after = rss.mark("done")
    memory = {
        **rss.to_json(),
        "before_mib": before,
        "after_compile_mib": compiled,
        "after_first_run_mib": first_run,
        "after_mib": after,
        "model_peak_mib": model_peak,  # compile, warm-up and timing, no profiler sessions
        # What the first run allocated: activations and the engine's arena (ONNX Runtime
        # does not report its arena size through its Python API).
        "first_run_growth_mib": first_run - compiled,
    }
    enough = wall_s >= MIN_CPU_WALL_S
    utilization = cpu_s / (wall_s * cores) if enough and cores else None
    idle = idle_s / machine_s if enough and machine_s > 0 else None
    return Measurement(latency, records, utilization, cores or 1, idle, memory, profiled_ms)


def _idle(times: Any) -> float:
    return times.idle + getattr(times, "iowait", 0.0)
