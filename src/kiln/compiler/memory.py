"""An artifact under a memory budget (`kiln optimize --max-memory 1.5GB`).

Each verified candidate's peak resident memory is measured by a `measure` the caller hands in
(the CLI's: the candidate saved and opened as a `kiln.Session` in a process of its own,
`kiln.runtime.footprint.peak_memory` — the compiler does not import the runtime). A candidate
over the budget is measured again with its engine's memory-saving options added one by one,
cheapest in time first, each kept only when it lowered the peak, until it fits; then the
option sets tried are timed interleaved against the engine's own, so the record says what each
saved and what it cost in latency.

What an option saves depends on the model, which is why each is measured rather than assumed
(the figures: "Memory-saving options" in docs/contributing/engine-notes.md). ONNX Runtime
memory-maps the weights an artifact keeps in its external file and reads every page once
whatever the options, so a transformer's peak barely moves; prepacking off keeps its weights in
the page cache rather than the process's own memory, at a cost in latency. Smaller models gain
from prepacking off, and large batches from the memory pattern off. OpenVINO: `release_mapped`
(on by default) gives back the mapped weight pages its CPU plugin has copied
(benchmarks/openvino_memory.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from kiln.backends import get_backend, options_from_json
from kiln.compiler.candidate import CompileResult
from kiln.errors import KilnError
from kiln.ir.inputs import synthesize
from kiln.timing import interleave, round_stats, speedups

# What `measure` returns, in MiB: "peak_mib" (the high-water mark over opening and running,
# the figure judged against the budget), and "load_mib", "steady_mib" where it knows them.
Measure = Callable[[CompileResult], Mapping[str, float]]
Say = Callable[[str], None]

# Each engine's options that can lower its peak, cheapest in time first. ONNX Runtime: the arena
# grows by what is asked rather than doubling (bert-base: 0.98× the latency, within noise; the
# pages a doubled region never touches are not resident, so it rarely lowers the peak either);
# no memory pattern (allocations per run instead of one block planned from the first: 1.06×,
# within noise); no prepacking (no packed copy of the MatMul/Conv weights; GEMMs slower: 1.30×).
# OpenVINO: `release_mapped`, for an artifact built with it off (latency within noise, 0.99-1.04×;
# nothing to release when the weights are read rather than mapped, `mmap` off); `release_code`
# (the library pages only the compile read: one slower run after each first run at a shape).
SAVINGS: dict[str, tuple[tuple[str, Any], ...]] = {
    "ort": (
        ("arena_extend", "same_as_requested"),
        ("memory_pattern", False),
        ("prepacking", False),
    ),
    "openvino": (("release_mapped", True), ("release_code", True)),
}
DEFAULT = "default"
# An option is kept only when it lowers the peak by more than this (MiB, and fraction of it):
# one that saves nothing measurable would cost time for nothing.
NOISE_MIB, NOISE = 1.0, 0.01


def fit_candidates(
    results: list[CompileResult],
    budget_mib: float,
    measure: Measure,
    *,
    rounds: int = 3,
    runs: int = 10,
    say: Say = lambda _m: None,
) -> tuple[list[CompileResult], dict[str, str]]:
    """The candidates that fit `budget_mib` (each with the options that made it fit and its
    `memory` record), and why the others were refused. KilnError, naming the smallest peak
    reached and how, when none fits."""
    fitted, refused = [], {}
    for result in results:
        if fit_memory(result, budget_mib, measure, rounds=rounds, runs=runs, say=say):
            fitted.append(result)
        else:
            assert result.memory is not None
            refused[result.label] = (
                f"peak {result.memory['smallest_peak_mib']:.0f} MiB at best, over "
                f"--max-memory ({budget_mib:.0f} MiB)"
            )
    if not fitted:
        best = min(results, key=lambda r: r.memory["smallest_peak_mib"] if r.memory else 0)
        assert best.memory is not None
        how = _describe(best.memory["smallest_with"]) or "its default options"
        raise KilnError(
            f"{best.loaded.source}: nothing fits --max-memory {budget_mib:.0f} MiB: the "
            f"smallest peak reached was {best.memory['smallest_peak_mib']:.0f} MiB "
            f"({best.label} with {how}). Nothing was written; raise --max-memory, or try a "
            "lower precision (--precision int8) or another --backend."
        )
    return fitted, refused


def fit_memory(
    result: CompileResult,
    budget_mib: float,
    measure: Measure,
    *,
    rounds: int = 3,
    runs: int = 10,
    say: Say = lambda _m: None,
) -> bool:
    """Whether `result` fits `budget_mib`, trying its engine's memory-saving options in order
    (each added to those that lowered the peak before it; one that lowers it by less than
    `NOISE` is not kept); when it fits, `result.options` and its config's engine options are
    the ones that did. `result.memory` records the budget, every option set tried with its
    memory and latency, and the pick."""
    tried: list[tuple[dict[str, Any], CompileResult, dict[str, float]]] = []

    def attempt(changes: dict[str, Any]) -> dict[str, float]:
        candidate = _with(result, changes)
        say(f"measuring the memory of {result.label} with {_describe(changes) or 'its defaults'}")
        memory = {k: float(v) for k, v in measure(candidate).items()}
        tried.append((changes, candidate, memory))
        return memory

    kept: dict[str, Any] = {}
    best = attempt(kept)["peak_mib"]
    for key, value in _savings(result):
        if tried[-1][2]["peak_mib"] <= budget_mib:
            break
        peak = attempt({**kept, key: value})["peak_mib"]
        if peak < best - max(NOISE_MIB, NOISE * best):
            kept, best = {**kept, key: value}, peak
    fits = tried[-1][2]["peak_mib"] <= budget_mib
    latency = _latency([c for _, c, _ in tried], rounds, runs, say) if len(tried) > 1 else {}
    smallest = min(tried, key=lambda t: t[2]["peak_mib"])
    record: dict[str, Any] = {
        "budget_mib": budget_mib,
        "fits": fits,
        "tried": [
            {"options": changes, **memory, **latency.get(_name(i), {})}
            for i, (changes, _, memory) in enumerate(tried)
        ],
        "smallest_peak_mib": smallest[2]["peak_mib"],
        "smallest_with": smallest[0],
    }
    if fits:
        changes, candidate, memory = tried[-1]
        record |= {"peak_mib": memory["peak_mib"], "options": changes}
        result.options, result.config = candidate.options, candidate.config
        result.notes.append(_note(result.label, budget_mib, record))
    result.memory = record
    return fits


def _savings(result: CompileResult) -> list[tuple[str, Any]]:
    """The engine's memory-saving options that change something here (not already set; no
    arena strategy without an arena)."""
    current = result.options.to_json()
    return [
        (key, value)
        for key, value in SAVINGS.get(result.backend, ())
        if current.get(key) != value and not (key == "arena_extend" and not current["memory_arena"])
    ]


def _with(result: CompileResult, changes: dict[str, Any]) -> CompileResult:
    """`result` running with `changes` on top of its engine options (the model is the same)."""
    if not changes:
        return result
    options = options_from_json(result.backend, {**result.options.to_json(), **changes})
    config = result.config.replace(engine_options={**result.config.engine_options, **changes})
    return replace(result, options=options, config=config, notes=list(result.notes))


def _name(index: int) -> str:
    return DEFAULT if index == 0 else f"step {index}"


def _latency(candidates: list[CompileResult], rounds: int, runs: int, say: Say) -> dict:
    """Each option set's P50 and its latency over the engine defaults' (> 1: slower), timed
    interleaved in this process on the first reference inputs."""
    first = candidates[0]
    feeds = first.feeds[0] if first.feeds else synthesize(first.model)
    backend = get_backend(first.backend)
    runners = {}
    for index, candidate in enumerate(candidates):
        exe = backend.compile(candidate.model, candidate.options)
        runners[_name(index)] = (lambda e: lambda: e.run(feeds))(exe)
    say("timing what each memory option costs, interleaved")
    samples = interleave(runners, rounds=max(rounds, 1), runs=runs)
    compared = speedups(samples, DEFAULT)
    out = {}
    for name, rounds_of in samples.items():
        ratio = compared[name].to_json()
        spread = ratio["speedup_spread"]
        out[name] = {
            "p50_ms": round_stats(rounds_of).p50_ms,
            # the latency with these options over the defaults': 1.08 = 8 % slower
            "latency_ratio": 1 / ratio["speedup"],
            "latency_ratio_spread": None if spread is None else [1 / spread[1], 1 / spread[0]],
            "verdict": ratio["verdict"],  # "slower": these options cost time, in every round
        }
    return out


def _describe(changes: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in changes.items())


def _note(label: str, budget_mib: float, record: dict[str, Any]) -> str:
    """One line for the manifest's notes and the table: the pick's peak beside its latency,
    and what each option set tried saved and cost."""
    tried = record["tried"]
    first, pick = tried[0], tried[-1]
    if len(tried) == 1:
        return (
            f"--max-memory {budget_mib:.0f} MiB: {label} peaks at {first['peak_mib']:.0f} MiB "
            "with its default options"
        )
    steps = "; ".join(
        f"{_describe(t['options'])}: {t['peak_mib']:.0f} MiB, "
        f"{t.get('latency_ratio', float('nan')):.2f}× the latency"
        for t in tried[1:]
    )
    return (
        f"--max-memory {budget_mib:.0f} MiB: {label} peaks at {first['peak_mib']:.0f} MiB with "
        f"its default options ({first.get('p50_ms', float('nan')):.2f} ms P50); {steps}; kept "
        f"{_describe(pick['options'])} ({pick['peak_mib']:.0f} MiB)"
    )
