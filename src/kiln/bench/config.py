"""`BenchConfig`: what one `kiln bench` run measures and how long, as data — what the verb's
flags are generated from — and `run(model, config)`, the benchmark it stands for
(`kiln.bench.report.run_bench`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kiln.errors import KilnError


@dataclass(frozen=True)
class BenchConfig:
    """Engines timed interleaved against one model, on which inputs, for how many runs."""

    against: str = "ort,ort-basic"
    """Comma-separated engines: ort, ort-basic, ort-transformers, ort-int8, openvino,
    openvino-bf16, openvino-int8 (the int8 ones: each tool's defaults, calibrated on the
    calibration samples or on synthetic ones). The first is the baseline."""
    batch: int = 1
    """Batch size of the synthesized inputs."""
    inputs: str | None = None
    """Time and measure drift on these inputs (.npz) instead of synthetic."""
    calib: str | None = None
    """Calibration samples (.npz or directory) for the int8 engines."""
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """INPUT=D0xD1x... for a synthesized input."""
    rounds: int = 5
    """Interleaved rounds."""
    runs: int = 20
    """Runs per engine per round (rounds × runs ≥ 662 back a P99 at 99 % confidence)."""
    memory: bool = True
    """Also measure each engine's peak resident memory (load and run), each in a process of
    its own, after the timing."""

    def __post_init__(self) -> None:
        for name in ("batch", "runs", "rounds"):
            value = getattr(self, name)
            if value < 1:
                raise KilnError(f"--{name} {value}: use at least 1.")


def run(
    model: str, config: BenchConfig, say: Callable[[str], None] = print, command: str = ""
) -> dict:
    """`model` against `config.against`, interleaved (see kiln.bench.report.run_bench);
    `command` is recorded in the result as what was run."""
    from kiln.bench.report import run_bench

    return run_bench(
        model, config.against, config.batch, config.rounds, config.runs, say, command,
        dict(config.shapes), inputs=config.inputs, calib=config.calib, memory=config.memory,
    )  # fmt: skip
