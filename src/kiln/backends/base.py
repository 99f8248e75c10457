"""The Backend contract every engine implements (see docs/contributing/architecture.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import onnx_ir as ir

from kiln.errors import KilnError


@dataclass(frozen=True)
class KernelRecord:
    """One kernel (ONNX Runtime) or executed layer (OpenVINO) of one profiled run.

    `provider` is what ran it: ONNX Runtime's execution provider, OpenVINO's exec type (the
    kernel, e.g. brgconv_avx512_f32). Optional fields are None where the engine does not say.
    """

    node: str  # the engine's name for the kernel
    op_type: str  # the engine's operator (ORT) or layer type (OpenVINO)
    provider: str
    dur_us: float
    run: int  # 0, 1, ... over the profiled runs; the warm-up is never recorded
    ts_us: float | None = None  # start, for timelines (ONNX Runtime)
    # the original layers the engine fused into this one (OpenVINO's originalLayersNames)
    origin: tuple[str, ...] | None = None


@dataclass
class Profile:
    """What `Executable.profile` measured: the kernel records of every profiled run, and each
    run's own wall time where the engine reports it (else empty)."""

    records: list[KernelRecord]
    run_ms: list[float]
    engine: str  # as `Backend.describe()["engine"]`: "onnxruntime", "openvino"


class Executable(Protocol):
    """A model compiled for one engine, ready to run."""

    input_names: list[str]
    output_names: list[str]
    # The engine's providers in ONNX Runtime's form: ["CPUExecutionProvider"], ["OpenVINO:CPU"]
    providers: list[str]

    def run(
        self, feeds: dict[str, np.ndarray], output_names: list[str] | None = None
    ) -> list[np.ndarray]: ...

    def profile(self, feeds: dict[str, np.ndarray], runs: int) -> Profile:
        """Per-kernel records over `runs` runs after one warm-up."""
        ...


class Backend(Protocol):
    name: str

    def available(self) -> bool: ...

    def describe(self) -> dict[str, str]: ...

    def compile(self, model: ir.Model | str, options: Any = None) -> Executable: ...


def check_flags(
    engine: str, options: object, flags: tuple[str, ...], optional: tuple[str, ...] = ()
) -> None:
    """Each of `flags` must be True or False, each of `optional` also None (the engine's own
    default): a manifest or a tuner that wrote "yes" or 1 is named here, not read as truthy."""
    for name in (*flags, *optional):
        value = getattr(options, name)
        if not isinstance(value, bool) and not (value is None and name in optional):
            allowed = "true, false or null" if name in optional else "true or false"
            raise KilnError(f"{engine} option '{name}' must be {allowed}, got {value!r}.")
