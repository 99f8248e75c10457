"""What the step profiler measured: `StepProfile`, and the parts a step is split into."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kiln.train.phases import PHASES

PARTS = (*PHASES, "communication", "other")  # "communication": exposed collectives only
CATEGORIES = ("parameters", "gradients", "optimizer state", "activations", "other")


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


def _rate(amount: int | None, step_ms: float) -> float | None:
    return amount * 1e3 / step_ms if amount and step_ms > 0 else None
