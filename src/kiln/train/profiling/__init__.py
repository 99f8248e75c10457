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

One module a concern: `measure` (the timed steps and `profile_steps`), `trace` (the profiled
steps' events and their spans), `memory` (the timeline by category), `diagnose` (the rules),
`advice` (each fix timed before it is given); the HTML page and the terminal view are
kiln.report.train's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from kiln.profile.finding import Finding
from kiln.train.profiling.advice import UNTRIED, try_advice
from kiln.train.profiling.diagnose import diagnose
from kiln.train.profiling.measure import profile_steps
from kiln.train.profiling.record import PARTS, StepProfile

__all__ = [
    "PARTS",
    "UNTRIED",
    "Finding",
    "StepProfile",
    "diagnose",
    "print_profile",
    "profile_steps",
    "try_advice",
    "write_report",
]


def write_report(profile: StepProfile, findings: list[Finding], path: str | os.PathLike) -> Path:
    """The self-contained HTML report (kiln.report.train: plotly embedded, nothing fetched),
    written atomically."""
    from kiln.report.train import write_train_html

    return write_train_html(profile.to_json(), [f.to_json() for f in findings], path)


def print_profile(profile: StepProfile, findings: list[Finding], console: Any) -> None:
    """The terminal view (kiln.report.train): the split, the FLOP/s and MFU, memory, the
    findings with their fixes."""
    from kiln.report.train import print_train_profile

    print_train_profile(profile.to_json(), [f.to_json() for f in findings], console)
