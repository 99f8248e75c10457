"""The placement from measurements: each candidate part timed on each engine with the threads
it would get, the hand-off between parts timed, and the placement that minimises the predicted
end-to-end latency — the parts of a stage run at once, so a stage costs its slowest part.
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir

from kiln.artifact.parts import PartSpec, stages
from kiln.backends import get_backend
from kiln.compiler.candidate import engine_options
from kiln.errors import counted
from kiln.timing import interleave, round_p50_ms

Say = Callable[[str], None]
Feeds = dict[str, np.ndarray]
HANDOFF_SAMPLES = 200


def cores() -> int:
    """The cores this process may run on (what the parts of a stage share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def thread_shares(parts: Sequence[PartSpec], given: Sequence[str], total: int) -> dict[str, int]:
    """Each part's threads: the cores divided among the parts of its stage (at least one)."""
    return {p.name: max(total // len(s), 1) for s in stages(parts, given) for p in s}


def option_overrides(engine: str, threads: int) -> dict[str, Any]:
    """A part's engine settings, as a CompileConfig's engine_options: its threads, and for ONNX
    Runtime a pool that stops spinning when a run ends — a part's idle pool must not take the
    cores of the parts still running beside it; for OpenVINO threads left unpinned."""
    if engine == "ort":
        return {"intra_op_threads": threads, "stop_spinning": True}
    # Unpinned: OpenVINO pins each model's threads from the first core, so two one-thread
    # parts running at once would share a core and take the sum of their times.
    return {"inference_num_threads": threads, "pin_threads": False}


@dataclass
class Measured:
    """Per part and engine the median-of-rounds P50 (ms), and the hand-off (ms)."""

    part_ms: dict[str, dict[str, float]]
    handoff_ms: float
    rounds: int
    runs: int

    def to_json(self) -> dict[str, Any]:
        return {
            "part_ms": self.part_ms,
            "handoff_ms": self.handoff_ms,
            "rounds": self.rounds,
            "runs_per_round": self.runs,
        }


def measure_parts(
    pieces: dict[str, ir.Model],
    specs: Sequence[PartSpec],
    engines: Sequence[str],
    feeds: dict[str, Feeds],
    crossing: list[np.ndarray],
    rounds: int,
    runs: int,
    say: Say,
    compile_piece: Callable[[str, str, Any], Any] | None = None,
) -> Measured:
    """Each piece on each engine at its part's threads, interleaved in one process; and the
    hand-off of a stage's work to another thread with the tensors that cross. A piece is
    compiled as it is (the original's), or by `compile_piece(name, engine, options)`."""
    runners: dict[str, Callable[[], object]] = {}
    for spec in specs:
        for engine in engines:
            say(f"compiling part {spec.name} for {engine} ({counted(spec.threads, 'thread')})")
            options = engine_options(engine, spec.precision, option_overrides(engine, spec.threads))
            if compile_piece is None:
                exe = get_backend(engine).compile(pieces[spec.name], options)
            else:
                exe = compile_piece(spec.name, engine, options)
            runners[f"{spec.name}@{engine}"] = _runner(exe, feeds[spec.name])
    say("timing every part on every engine, interleaved")
    samples = interleave(runners, rounds=rounds, runs=runs,
                         on_round=lambda r: say(f"timing parts, round {r}/{rounds}"))  # fmt: skip
    part_ms = {s.name: {e: round_p50_ms(samples[f"{s.name}@{e}"]) for e in engines} for s in specs}
    return Measured(part_ms, handoff_ms(crossing), rounds, runs)


def _runner(exe: Any, feeds: Feeds) -> Callable[[], object]:
    return lambda: exe.run(feeds)


def handoff_ms(tensors: list[np.ndarray]) -> float:
    """What moving a part to another thread costs: submitting it and taking its result, with a
    copy of the tensors that cross (the engines hand outputs over as new arrays)."""
    with ThreadPoolExecutor(1) as pool:
        pool.submit(int).result()  # the thread exists before the clock starts
        times = []
        for _ in range(HANDOFF_SAMPLES):
            start = time.perf_counter()
            pool.submit(lambda: [np.copy(t) for t in tensors]).result()
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


@dataclass(frozen=True)
class Placement:
    """An engine per part, the end-to-end time the measurements predict for it, and the CPU
    time its parts take in all (of two placements predicted alike, the one that leaves more
    of the cores to the rest of the machine wins)."""

    engines: dict[str, str]
    predicted_ms: float
    work_ms: float = 0.0


def predict_placement(
    assignment: dict[str, str],
    specs: Sequence[PartSpec],
    given: Sequence[str],
    measured: Measured,
) -> float:
    """A stage costs its slowest part, plus a hand-off when it runs more than one at once;
    stages follow one another."""
    total = 0.0
    for stage in stages(specs, given):
        total += max(measured.part_ms[p.name][assignment[p.name]] for p in stage)
        if len(stage) > 1:
            total += measured.handoff_ms
    return total


def placements(
    specs: Sequence[PartSpec], given: Sequence[str], engines: Sequence[str], measured: Measured
) -> list[Placement]:
    """Every assignment of engines to parts with its predicted time, fastest first."""
    names = [s.name for s in specs]
    out = []
    for choice in itertools.product(engines, repeat=len(names)):
        assignment = dict(zip(names, choice, strict=True))
        work = sum(measured.part_ms[n][e] for n, e in assignment.items())
        predicted = predict_placement(assignment, specs, given, measured)
        out.append(Placement(assignment, predicted, work))
    return sorted(out, key=lambda p: (p.predicted_ms, p.work_ms))


def describe(placement: Placement) -> str:
    return ",".join(f"{part}={engine}" for part, engine in placement.engines.items())
