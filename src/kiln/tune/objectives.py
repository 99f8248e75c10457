"""What a study optimizes and under which limits, in the CLI's words: `--objective latency`
(several: a Pareto front) and constraints such as `--max-p50 20ms`."""

from __future__ import annotations

import re
from dataclasses import dataclass

from kiln.errors import KilnError
from kiln.units import parse_duration, parse_size


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


# flag → (measure, at most?)
LIMITS = {
    "max_p50": ("p50_ms", True),
    "max_p99": ("p99_ms", True),
    "max_jitter": ("jitter", True),
    "max_memory": ("memory_mib", True),
    "min_throughput": ("throughput", False),
}
_EXAMPLES = {"p50_ms": "20ms", "p99_ms": "50ms", "memory_mib": "2GB"}
_TIME_UNITS = " with a unit (us, ms, s)"
_UNITS = {"p50_ms": _TIME_UNITS, "p99_ms": _TIME_UNITS,
          "memory_mib": " with a unit (kB, MB, GB decimal; KiB, MiB, GiB binary)"}  # fmt: skip


def parse_constraint(flag: str, text: str) -> Constraint:
    """`max_p50`, "20ms" → p50_ms ≤ 20; `max_memory`, "2GiB" → memory_mib ≤ 2048. Latency and
    memory limits need a unit (a bare "20" is 20 ms to one user and 20 s to the next; sizes
    read as kiln.units does: kB/MB/GB decimal, KiB/MiB/GiB binary); jitter and throughput
    (samples/s) are bare numbers."""
    measure, at_most = LIMITS[flag]
    name = f"--{flag.replace('_', '-')}"
    try:
        if measure.endswith("_ms"):
            bound = parse_duration(text, bare_unit=None) * 1e3
        elif measure == "memory_mib":
            bound = parse_size(text, bare_unit=None) / 2**20
        else:
            bound = _bare_number(text, per_second=measure == "throughput")
    except ValueError:
        unit = _UNITS.get(measure, "")
        example = _EXAMPLES.get(measure, "0.2")
        raise KilnError(f"{name} {text}: expected a number{unit}, e.g. {name} {example}.") from None
    return Constraint(measure, bound, at_most, f"{name} {text}")


def _bare_number(text: str, per_second: bool) -> float:
    """A unitless limit; a throughput may say its unit ("300/s", "300 samples/s")."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*([a-zA-Z/]*)\s*", text)
    units = ("", "/s", "samples/s") if per_second else ("",)
    if not match or match.group(2).lower() not in units:
        raise ValueError(f"{text!r}: expected a number")
    return float(match.group(1))
