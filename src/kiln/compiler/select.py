"""`engine="auto"` / `precision="auto"`: every concrete candidate, each built and verified, timed
interleaved against the original under ONNX Runtime's defaults; the fastest verified one wins,
or, among those within noise of it, the one with the lowest P99. Precision auto also builds each
hand recipe (an engine's own tool at its defaults on the original graph), so the pick is never
behind what a user could run by hand.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kiln.backends import available_backends, get_backend
from kiln.backends.ort import OrtOptions
from kiln.backends.release import collect_garbage
from kiln.compiler.candidate import CompileResult
from kiln.config import AUTO, ENGINES, HAND, PRECISIONS, RECIPES, CompileConfig
from kiln.errors import KilnError
from kiln.ir.inputs import synthesize
from kiln.precision import ENGINES_FOR, check_precision, has_hand_recipe
from kiln.timing import (
    FASTER,
    SAME,
    SLOWER,
    interleave,
    p99_backing,
    round_stats,
    speedups,
    tail_interval,
)

Say = Callable[[str], None]
UNCALIBRATED = ("fp32", "bf16")  # precisions built without calibration data


def candidates(config: CompileConfig) -> list[CompileConfig]:
    """The concrete configs `config` stands for: itself, or one per installed engine
    (engine auto) and per precision that engine runs (precision auto)."""
    if config.engine == AUTO:
        if config.engine_options:
            raise KilnError("engine options apply to one engine: give --backend ort|openvino.")
        engines = [e for e in available_backends() if e in ENGINES]
    else:
        get_backend(config.engine)  # fails now, with its reason, if the engine is missing
        engines = [config.engine]
    levels = list(PRECISIONS) if config.precision == AUTO else [config.precision]
    pairs = [(e, p) for p in levels for e in engines if e in ENGINES_FOR[p]]
    if not pairs:
        check_precision(engines[0] if engines else config.engine, config.precision)
        raise KilnError(f"no installed engine runs {config.precision}; install openvino.")
    if config.recipe is not None:
        return _recipe_candidates(config, pairs)
    own = [config.replace(engine=e, precision=p, static=_static(config, e)) for e, p in pairs]
    own += static_twins(config, own)
    if config.precision != AUTO:
        return own
    # Every hand recipe is a candidate too: the pick must not lose to one a user could run.
    by_hand = [(e, p) for e, p in pairs if has_hand_recipe(e, p)]
    return own + [
        config.replace(engine=e, precision=p, recipe=HAND, pipeline=(), static=_static(config, e))
        for e, p in by_hand
    ]


def static_twins(config: CompileConfig, own: list[CompileConfig]) -> list[CompileConfig]:
    """Engine auto with dims the user pinned (`shapes`): each OpenVINO candidate also compiled
    static at the verified dims, timed like the rest rather than assumed: static can win at
    long sequences and be within noise of dynamic at short ones (benchmarks/long_seq.py; the
    dynamic dims note in docs/contributing/engine-notes.md). Without pinned dims the verified
    ones are Kiln's guess, no shape to specialise for. Unquantized candidates only: a quantized
    twin would calibrate all over again (kiln tune searches `openvino.static` at every
    precision)."""
    if config.engine != AUTO or config.static or not config.shapes:
        return []
    return [c.replace(static=True) for c in own
            if c.engine == "openvino" and c.precision in UNCALIBRATED]  # fmt: skip


def _static(config: CompileConfig, engine: str) -> bool:
    """`static` kept for the OpenVINO candidates of an auto config, dropped for ORT's."""
    return config.static and engine != "ort"


def _recipe_candidates(config: CompileConfig, pairs: list[tuple[str, str]]) -> list[CompileConfig]:
    """A config that names a recipe: the engines and precisions that recipe runs."""
    wanted = RECIPES.get(config.recipe or "")
    fits = [(e, p) for e, p in pairs if (e, p) == wanted or (wanted is None and
                                                              has_hand_recipe(e, p))]  # fmt: skip
    if not fits:
        raise KilnError(
            f"recipe '{config.recipe}' runs on none of {', '.join(f'{e}/{p}' for e, p in pairs)}."
        )
    return [config.replace(engine=e, precision=p, static=_static(config, e)) for e, p in fits]


# Room to leave before holding one more session: twice the largest one's footprint after its
# first run (the next one's, and what those held still grow: at 4,096 tokens the process held
# 17.8 GiB once the original's and seven candidates' sessions had run once, 21.4 GiB by the end
# of the timing), and 1 GiB.
HEADROOM = 2.0
RESERVE_BYTES = 1 << 30


def time_candidates(results: list[CompileResult], rounds: int, runs: int, say: Say) -> dict:
    """The original under ORT_ENABLE_ALL against each candidate, interleaved in one process,
    on the first reference input set. The candidates' sessions are held in groups that fit in
    memory (one session of bert-base-4k at 4,096 tokens holds 2–4 GiB, its weights and its
    activations; eleven at once do not fit in 24 GiB): each group is timed interleaved with
    the original, so every speedup is still against the original measured beside it.
    `groups` says how many there were."""
    original = results[0].loaded.model
    feeds = results[0].feeds[0] if results[0].feeds else synthesize(original)
    baseline = get_backend("ort").compile(
        original,
        OrtOptions(optimization="all", stop_spinning=False),  # ORT as-is
    )
    baseline.run(feeds)  # its arena grown before any candidate's footprint is read
    samples: dict[str, list[list[float]]] = {"ort": []}
    compared: dict[str, Any] = {}
    group: dict[str, Callable[[], object]] = {}
    largest, groups = 0, 0
    for index, result in enumerate(results):
        before = _resident_bytes()
        exe = get_backend(result.backend).compile(result.model, result.options)
        exe.run(feeds)
        largest = max(largest, _resident_bytes() - before)
        group[result.label] = (lambda e: lambda: e.run(feeds))(exe)
        del exe
        if index < len(results) - 1 and _room_for(largest):
            continue
        groups += 1
        say(_group_message(len(group), groups, index < len(results) - 1 or groups > 1))
        got, ratios = _time_group(lambda: baseline.run(feeds), group, rounds, runs, say)
        compared |= ratios
        samples["ort"] += got.pop("ort")
        samples |= got
        group.clear()
        collect_garbage()
    return {
        "rounds": rounds,
        "runs_per_round": runs,
        "groups": groups,
        "original_ort": round_stats(samples["ort"]).to_json(),
        "candidates": {
            r.label: {
                **round_stats(samples[r.label]).to_json(),
                **tail_interval(samples[r.label]).to_json(),
                **compared[r.label].to_json(),
            }
            for r in results
        },
    }


def _time_group(
    original: Callable[[], object],
    group: dict[str, Callable[[], object]],
    rounds: int,
    runs: int,
    say: Say,
) -> tuple[dict[str, list[list[float]]], dict[str, Any]]:
    """One group of candidates timed interleaved with the original (`"ort"`): every run's
    samples, the original's included, and each candidate's speedup over the original."""
    got = interleave(
        {"ort": original, **group}, rounds=rounds, runs=runs,
        on_round=lambda r: say(f"timing round {r}/{rounds}"),
    )  # fmt: skip
    return got, {name: ratio for name, ratio in speedups(got, "ort").items() if name in group}


def _group_message(size: int, number: int, grouped: bool) -> str:
    what = f"{size} candidates" if size > 1 else "1 candidate" if grouped else "the artifact"
    message = f"timing the original (ORT_ENABLE_ALL) and {what}, interleaved"
    if not grouped:
        return message
    return f"{message} (group {number}: memory holds no more sessions at once)"


def _resident_bytes() -> int:
    import psutil

    collect_garbage()
    return psutil.Process().memory_info().rss


def _room_for(footprint: int) -> bool:
    """Whether memory still holds another session of `footprint` bytes, with headroom."""
    import psutil

    return psutil.virtual_memory().available >= footprint * HEADROOM + RESERVE_BYTES


def fastest(results: list[CompileResult], timing: dict[str, Any]) -> tuple[CompileResult, dict]:
    """The verified candidate with the best speedup — or, among those within noise of it, the
    one with the lowest P99 — and the manifest's benchmark: its speedup, spread and verdict
    against the original, every candidate's, and why it was chosen (`choice_reason`)."""
    timed = timing["candidates"]
    top = max(results, key=lambda r: timed[r.label]["speedup"])
    ties = [r for r in results if within_noise(timed[r.label], timed[top.label])]
    best = min(ties, key=lambda r: (timed[r.label]["p99_ms"], r is not top))
    chosen = timed[best.label]
    bench = {
        "rounds": timing["rounds"],
        "runs_per_round": timing["runs_per_round"],
        "groups": timing.get("groups", 1),
        "original_ort": timing["original_ort"],
        "artifact": chosen,
        **p99_backing(timing["rounds"] * timing["runs_per_round"]),  # the artifact's P99
        "speedup": chosen["speedup"],
        "speedup_spread": chosen["speedup_spread"],
        "verdict": chosen["verdict"],
        "choice": best.label,
        "choice_reason": choice_reason(best.label, top.label, [r.label for r in ties], timed),
        "candidates": {name: c["speedup"] for name, c in timed.items()},
        "candidate_verdicts": {
            name: {k: c[k] for k in ("speedup", "speedup_spread", "verdict")}
            for name, c in timed.items()
        },
    }
    return best, bench


# A verdict against the original, from best to worst: a near-tie never says less than the best.
VERDICT_RANK = {FASTER: 0, SAME: 1, SLOWER: 2}


def within_noise(candidate: dict[str, Any], best: dict[str, Any]) -> bool:
    """Whether `candidate`'s speedup is no different from `best`'s within noise: their
    per-round speedup spreads overlap, and its verdict against the original is as good (a
    pick the table calls faster is never swapped for one it calls no different). Unknown
    spreads (fewer than 3 rounds) tell nothing apart: only the best is within noise then."""
    if candidate is best:
        return True
    ours, theirs = candidate.get("speedup_spread"), best.get("speedup_spread")
    if not ours or not theirs:
        return False
    rank = VERDICT_RANK.get(candidate.get("verdict"), 3)
    return ours[1] >= theirs[0] and rank <= VERDICT_RANK.get(best.get("verdict"), 3)


def choice_reason(chosen: str, top: str, ties: list[str], timed: dict[str, Any]) -> str:
    """Why `chosen` won, in words: the fastest alone, or the lowest P99 among those within
    noise of the fastest (`top`)."""
    speed = timed[chosen]["speedup"]
    others = [t for t in ties if t != chosen]
    if not others:
        alone = "no other within noise" if len(timed) > 1 else "the only candidate"
        return f"the fastest verified candidate ({speed:.2f}×; {alone})"
    p99 = timed[chosen]["p99_ms"]
    rivals = ", ".join(f"{t} {timed[t]['speedup']:.2f}× P99 {timed[t]['p99_ms']:.3g} ms"
                       for t in others)  # fmt: skip
    if chosen == top:
        return (f"the fastest verified candidate ({speed:.2f}×, P99 {p99:.3g} ms), and its P99 is "
                f"the lowest of those within noise of it ({rivals})")  # fmt: skip
    return (f"within noise of the fastest ({speed:.2f}× vs {timed[top]['speedup']:.2f}×) with the "
            f"lowest P99 among them: {p99:.3g} ms (against {rivals})")  # fmt: skip
