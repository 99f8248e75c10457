"""CPU model, ISA features that matter to engines, cores, caches: read from the OS, never
measured."""

from __future__ import annotations

import hashlib
import os
import platform
import re
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path

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


# Dot-product instructions that accumulate uint8 × int8 in int32 without int16 saturation.
WIDE_INT8_DOT = ("avx512_vnni", "avx_vnni", "amx_int8")


# The widest matrix instructions decide what a CPU can do for a model: the first one present
# names the class (AMX tiles, then bf16 dot products, int8 dot products, plain AVX-512, AVX2).
_ISA_CLASSES = (
    ("amx_tile", "amx"),
    ("avx512_bf16", "avx512bf16"),
    ("avx512_vnni", "avx512vnni"),
    ("avx512f", "avx512"),
    ("avx2", "avx2"),
    ("sve", "sve"),
    ("asimd", "neon"),
)
_FAMILIES = (
    ("epyc", "amd-epyc"),
    ("ryzen", "amd-ryzen"),
    ("xeon", "intel-xeon"),
    ("core", "intel-core"),
    ("neoverse", "arm-neoverse"),
    ("graviton", "aws-graviton"),
)


def class_of(model: str, features: list[str]) -> str:
    """`amd-epyc-avx512bf16`, `intel-xeon-amx`: the CPU family and its widest matrix ISA."""
    lowered = model.lower()
    family = next((name for key, name in _FAMILIES if key in lowered), None)
    if family is None:
        words = re.findall(r"[a-z0-9]+", lowered)[:2]
        family = "-".join(words) or platform.machine().lower() or "cpu"
    isa = next((name for flag, name in _ISA_CLASSES if flag in features), "generic")
    return f"{family}-{isa}"


@dataclass(frozen=True)
class CpuInfo:
    model: str
    machine: str
    logical_cores: int
    physical_cores: int
    features: list[str]
    # data/unified cache level ("L2", "L3") → bytes, summed over the distinct caches of the
    # cores this process may run on (a kernel split over the cores has all of them)
    caches: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {**asdict(self), "class": self.cpu_class}

    @property
    def cpu_class(self) -> str:
        """The name results are filed under, e.g. `amd-epyc-avx512bf16` (class_of)."""
        return class_of(self.model, self.features)

    @property
    def int8_dot_saturates(self) -> bool:
        """True on x86 without VNNI: engines multiply uint8 by int8 with VPMADDUBSW, whose
        pairwise int16 sums saturate for full-range int8 weights (255·128·2 > 32767), so
        weights are quantized to 7 bits there (ONNX Runtime's `reduce_range`)."""
        return "avx2" in self.features and not any(f in self.features for f in WIDE_INT8_DOT)

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
        caches=cache_sizes(),
    )


def cache_sizes(root: Path = Path("/sys/devices/system/cpu")) -> dict[str, int]:
    """Bytes of each data cache level over the CPUs this process may use, from sysfs (one
    L2 per core and one L3 per core complex are counted once each); {} where sysfs has none."""
    cpus = (
        os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
    )
    seen: dict[str, dict[str, int]] = {}
    for cpu in cpus:
        for index in sorted((root / f"cpu{cpu}" / "cache").glob("index*")):
            try:
                kind = (index / "type").read_text().strip()
                level = int((index / "level").read_text())
                size = _size_bytes((index / "size").read_text().strip())
                shared = (index / "shared_cpu_list").read_text().strip()
            except (OSError, ValueError):
                continue
            if kind == "Instruction" or level < 2:
                continue
            seen.setdefault(f"L{level}", {})[shared] = size
    return {level: sum(sizes.values()) for level, sizes in sorted(seen.items())}


def _size_bytes(text: str) -> int:
    """sysfs cache sizes: "512K", "32768K", "8M"."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text and text[-1].upper() in units:
        return int(text[:-1]) * units[text[-1].upper()]
    return int(text)
