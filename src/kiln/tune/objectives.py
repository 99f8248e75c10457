"""What a study optimizes and under which limits, in the CLI's words: `--objective latency`
(several: a Pareto front) and constraints such as `--max-p50 20ms`."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kiln.errors import KilnError


@dataclass(frozen=True)
class Objective:
    name: str
    measure: str  # the key of a trial's measures it reads
    direction: str  # "minimize" | "maximize"
    unit: str

    def better(self, a: float, b: float) -> bool:
        return a < b if self.direction == "minimize" else a > b


OBJECTIVES = {
    "latency": Objective("latency", "p50_ms", "minimize", "ms"),
    "p99": Objective("p99", "p99_ms", "minimize", "ms"),
    "jitter": Objective("jitter", "jitter", "minimize", ""),
    "throughput": Objective("throughput", "throughput", "maximize", "samples/s"),
    "memory": Objective("memory", "memory_mib", "minimize", "MiB"),
}


def parse_objectives(names: list[str]) -> list[Objective]:
    """`["latency", "p99"]` or `["latency,p99"]` into objectives, in order, each once."""
    words = [w.strip() for name in names for w in name.split(",") if w.strip()]
    unknown = [w for w in words if w not in OBJECTIVES]
    if unknown or not words:
        raise KilnError(
            f"unknown objective '{unknown[0] if unknown else ''}'; use one or more of "
            f"{', '.join(OBJECTIVES)} (several: a Pareto front)."
        )
    return [OBJECTIVES[w] for w in dict.fromkeys(words)]


@dataclass(frozen=True)
class Constraint:
    """A limit a pick must meet: `measure` at most (or at least) `bound`."""

    measure: str
    bound: float
    at_most: bool
    text: str

    def violation(self, measures: dict[str, float]) -> float:
        """≤ 0 when met (Optuna's convention for constraints)."""
        value = measures[self.measure]
        return value - self.bound if self.at_most else self.bound - value


# flag → (measure, at most?, unit of the number, what units it accepts)
LIMITS = {
    "max_p50": ("p50_ms", True),
    "max_p99": ("p99_ms", True),
    "max_jitter": ("jitter", True),
    "max_memory": ("memory_mib", True),
    "min_throughput": ("throughput", False),
}
# Times and sizes need their unit: a bare "20" is 20 ms to one user and 20 s to the next.
_TIME = {"us": 1e-3, "ms": 1.0, "s": 1e3}
# In MiB: kB/MB/GB are the decimal units (10^3, 10^6, 10^9 bytes), KiB/MiB/GiB the binary ones.
_SIZE = {"kb": 1e3 / 2**20, "kib": 1 / 1024, "mb": 1e6 / 2**20, "mib": 1.0,
         "gb": 1e9 / 2**20, "gib": 1024.0}  # fmt: skip


def parse_constraint(flag: str, text: str) -> Constraint:
    """`max_p50`, "20ms" → p50_ms ≤ 20; `max_memory`, "2GiB" → memory_mib ≤ 2048. Latency and
    memory limits need a unit; jitter and throughput (samples/s) are bare numbers."""
    measure, at_most = LIMITS[flag]
    name = f"--{flag.replace('_', '-')}"
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*([a-zA-Z/]*)\s*", text)
    units = _TIME if measure.endswith("_ms") else _SIZE if measure == "memory_mib" else {"": 1.0}
    unit = match.group(2).lower() if match else None
    if measure == "throughput" and unit in ("/s", "samples/s"):
        unit = ""
    if not match or unit not in units:
        example = {"p50_ms": "20ms", "p99_ms": "50ms", "memory_mib": "2GB"}.get(measure, "0.2")
        unit_text = "" if "" in units else f" with a unit ({', '.join(units)})"
        raise KilnError(f"{name} {text}: expected a number{unit_text}, e.g. {name} {example}.")
    return Constraint(measure, float(match.group(1)) * units[unit], at_most, f"{name} {text}")
