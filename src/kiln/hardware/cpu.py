"""CPU model, ISA features that matter to engines, cores: read from the OS, never measured."""

from __future__ import annotations

import hashlib
import os
import platform
from dataclasses import asdict, dataclass
from functools import cache

# Features that decide which kernels engines can use.
INTERESTING_FLAGS = [
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "amx_tile",
    "amx_int8",
    "amx_bf16",
    "asimd",
    "sve",
]


@dataclass(frozen=True)
class CpuInfo:
    model: str
    machine: str
    logical_cores: int
    physical_cores: int
    features: list[str]

    def to_json(self) -> dict:
        return asdict(self)

    @property
    def fingerprint(self) -> str:
        text = f"{self.model}|{self.machine}|{self.logical_cores}|{','.join(self.features)}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]


@cache
def cpu_info() -> CpuInfo:
    model, flags, cores = platform.processor() or platform.machine(), set(), set()
    try:
        with open("/proc/cpuinfo") as file:
            text = file.read()
    except OSError:
        text = ""
    physical_id = "0"
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "model name":
            model = value
        elif key in ("flags", "Features"):
            flags.update(value.split())
        elif key == "physical id":
            physical_id = value
        elif key == "core id":
            cores.add((physical_id, value))
    logical = os.cpu_count() or 1
    return CpuInfo(
        model=model,
        machine=platform.machine(),
        logical_cores=logical,
        physical_cores=len(cores) or logical,
        features=[f for f in INTERESTING_FLAGS if f in flags],
    )
