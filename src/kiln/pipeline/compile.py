"""`kiln.compile_pipeline`: each model of a pipeline compiled, lossy choices judged on the
pipeline's final output.

1. The reference: the function over the data with every model as it is (fp32), recorded call
   by call (recording.py), then run once more: a pipeline whose results differ between two
   fp32 runs is refused, since a metric over it would judge noise.
2. Each model compiled by `kiln.compile` at fp32 and at each lossy precision asked for, on the
   engine asked for (auto: each installed engine built, verified and timed, the fastest
   kept — per stage, so a detector and a recogniser may run on different engines): its
   calibration set is the feeds it received in the reference run, its verification inputs
   the first of them — each candidate passes its own model's check as a plain compile's
   does, or is dropped with the reason.
3. The choice across stages, searched greedily: stages in the order of their share of the
   reference time, each of a stage's lossy candidates tried with the others at their
   current choice; eligible only while the pipeline's metric over the whole data set stays
   within `max_drop` of the reference's, and only where it is faster than the choice it
   would replace (timed interleaved on the stage's recorded calls): a lossy choice must
   pay. The fastest eligible one is kept. Every trial is kept with its metric, the stage's
   time and the timing's verdict.
   Then the glue's Kiln ops around each stage are folded into its chosen artifact where the
   result is the same and measures faster (fold.py); each stage's verdict is kept. And each
   stage's calls from several streams are merged into one run only where a batch measures
   faster per sample (merging.py).
4. The artifact: a directory with `pipeline.json` (pipeline_artifact.py), each stage's chosen
   `.kiln`, and the function's module file, so that it runs elsewhere.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kiln.config import TIMING, CompileConfig
from kiln.errors import KilnError
from kiln.home import output_problem
from kiln.pipeline.data import Metric, load_data, load_metric
from kiln.pipeline.fold import fold_stages
from kiln.pipeline.function import PipelineFunction, check_models, load_function
from kiln.pipeline.merging import decide_merging
from kiln.pipeline.pipeline_artifact import is_pipeline, write_pipeline
from kiln.pipeline.recording import Recording, record
from kiln.timing import FASTER, SLOWER, Speedup, interleave, speedup

Say = Callable[[str], None]
CALIB_SAMPLES = 32  # recorded calls a stage calibrates on, spread over the run
# A lossy candidate is timed against the stage's choice on this many of its recorded calls,
# in this many interleaved rounds: enough for a verdict (kiln.timing), a few seconds a stage.
TIMED_CALLS, TIMED_ROUNDS = 4, 3


@dataclass
class Trial:
    """One end-to-end judgement: `stage` at `precision`, the others at their choice then."""

    stage: str
    precision: str
    metric: float
    drop: float
    kept: bool
    # The stage's time over the whole data set at the choice it would replace (the reference
    # run's), and at this one: that time over the interleaved timing's speedup, so the two
    # figures and the speedup always agree (a trial's own run is cold: new sessions).
    stage_ms: float
    baseline_ms: float
    reason: str = ""
    speedup: float = 1.0  # the stage timed interleaved against that choice (stage_speedup)
    speed_verdict: str = ""

    def to_json(self) -> dict[str, Any]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in vars(self).items()}


@dataclass
class Stage:
    """A model of the pipeline: its source, its compiled candidates and the choice."""

    name: str
    source: str
    candidates: dict[str, Path] = field(default_factory=dict)  # precision → artifact
    refused: dict[str, str] = field(default_factory=dict)  # precision → why
    choice: str = "fp32"


def compile_pipeline(
    function: PipelineFunction | str,
    models: Mapping[str, str | os.PathLike],
    data: str | os.PathLike | Sequence[Any],
    output: str | os.PathLike,
    *,
    metric: str | Metric = "exact",
    max_drop: float = CompileConfig.max_drop,
    backend: str = CompileConfig.engine,
    precisions: Sequence[str] = (),
    streams: int = 1,
    force: bool = False,
    say: Say | None = None,
) -> Path:
    """Compile the pipeline `function` over `models` ({name: ONNX path}), judged on `data`
    (see data.py) by `metric`: a lossy precision of `precisions` (none by default, as `kiln
    optimize`; `lossy_precisions("auto", backend)` names every one this machine runs) is kept
    for a stage only while the metric stays within `max_drop` of the fp32 pipeline's and the
    stage runs faster with it. `backend`: each stage's engine (auto: the fastest per stage).
    `streams`: how many streams it is meant to serve at once (recorded: the count `kiln
    profile` runs it at). Write the pipeline artifact `output` (replacing a pipeline
    artifact there; anything else only with `force`); returns its path."""
    say = say or (lambda line: None)
    spec = function if isinstance(function, str) else ""
    fn = load_function(function) if isinstance(function, str) else function
    check_models(fn, list(models), spec)
    _check_inputs(models, output, max_drop, force)
    if streams < 1:
        raise KilnError(f"--streams {streams}: give 1 or more.")
    metric_name, score = load_metric(metric)
    inputs = load_data(data) if not isinstance(data, list | tuple) else load_data(list(data))
    say(f"recording the reference over {len(inputs)} inputs ...")
    reference = _reference(fn, models, inputs, score)
    top = score(reference.results, reference.results)
    stages = {name: Stage(name, str(Path(path).absolute())) for name, path in models.items()}
    with tempfile.TemporaryDirectory(prefix="kiln-pipeline-") as work:
        for stage in stages.values():
            _compile_stage(stage, reference, Path(work), backend, precisions, say)
        trials, seconds = _search(fn, stages, inputs, reference, score, top, max_drop, say)
        # Array work folded into each stage's chosen artifact where the same and faster.
        folds = fold_stages(fn, stages, inputs, reference, score, say, streams=streams)
        merges = decide_merging(stages, reference, say)  # which stages' calls share runs
        final = _final_check(fn, stages, inputs, reference, score, top, max_drop, say)
        record_ = {
            "metric": {"name": metric_name, "reference": top, "final": final,
                       "max_drop": max_drop},
            "reference": _reference_json(reference, len(inputs)),
            "search": {"order": _order(reference, stages), "trials": [t.to_json() for t in trials],
                       "seconds": round(seconds, 3), "space": _space(stages)},
            "folds": folds,
            "merging": merges,
            "streams": streams,
        }  # fmt: skip
        return write_pipeline(Path(output), fn, stages, record_)


def lossy_precisions(precision: str, backend: str = CompileConfig.engine) -> tuple[str, ...]:
    """The lossy precisions `--precision` asks each stage to be tried at: none for fp32, the
    one named, or for auto every lossy precision an engine of `backend` runs on this CPU
    (bf16 only where OpenVINO computes in bf16 here: AMX or AVX512_BF16)."""
    if precision == "fp32":
        return ()
    if precision != "auto":
        return (precision,)
    from kiln.backends import available_backends
    from kiln.precision import ENGINES_FOR

    engines = available_backends() if backend == "auto" else [backend]
    found = [p for p in ("bf16", "int8") if any(e in ENGINES_FOR[p] for e in engines)]
    if "bf16" in found:
        from kiln.backends.openvino import cpu_runs_bf16

        if not cpu_runs_bf16():
            found.remove("bf16")
    return tuple(found)


def _check_inputs(models: Mapping[str, Any], output: Any, max_drop: float, force: bool) -> None:
    for name, path in models.items():
        if not Path(path).is_file():
            raise KilnError(f"--model {name}={path}: no such file.")
    problem = output_problem(Path(output), directory=True)
    if problem:
        raise KilnError(f"-o {output}: {problem}")
    if Path(output).exists() and not is_pipeline(output) and not force:
        raise KilnError(
            f"-o {output}: something that is not a pipeline artifact is there; choose another "
            "path, or give --force to replace it."
        )
    if not 0 <= max_drop < 1:
        raise KilnError(f"--max-drop {max_drop}: give a drop of the metric in [0, 1).")


def _reference(fn: PipelineFunction, models: Mapping[str, Any], inputs: list[Any], score: Metric):
    """The recorded fp32 run, checked to repeat itself exactly under the metric: run twice,
    the second (its engines warm, so its times are the steady ones) is the reference."""
    from kiln.runtime import Session

    sessions = {name: Session(str(path)) for name, path in models.items()}
    try:
        first = record(fn, sessions, inputs)
        reference = record(fn, sessions, inputs)  # warm: its times are the reference's
    finally:
        for session in sessions.values():
            session.close()
    if score(first.results, reference.results) < score(first.results, first.results):
        raise KilnError(
            "the pipeline's results differ between two runs with the same fp32 models: a "
            "metric over them would judge noise, not precision. Make the function "
            "deterministic (a fixed seed, a stable order) and compile again."
        )
    _keep_quickest(reference, first)
    return reference


def _keep_quickest(reference: Recording, other: Recording) -> None:
    """Each call's and input's time: the quicker of the two runs. A first call on a new shape
    can be slow in either run (an engine's first run of it), and such a call would make a small
    model look like the pipeline's costliest stage."""
    if [c.model for c in reference.calls] != [c.model for c in other.calls]:
        return  # the runs called the models differently: each keeps its own times
    for mine, theirs in zip(reference.calls, other.calls, strict=True):
        mine.seconds = min(mine.seconds, theirs.seconds)
    reference.seconds = [min(a, b) for a, b in zip(reference.seconds, other.seconds, strict=True)]


def _compile_stage(
    stage: Stage, reference: Recording, work: Path, backend: str,
    precisions: Sequence[str], say: Say,
) -> None:  # fmt: skip
    """The stage's fp32 artifact and each lossy candidate, calibrated on its recorded feeds."""
    import kiln

    feeds = reference.feeds(stage.name)
    if not feeds:
        say(f"  {stage.name}: never called on this data; kept as it is (fp32)")
    example = feeds[0] if feeds else None
    calib = _calibration_dir(feeds, work / f"{stage.name}-calib") if feeds else None
    for precision in ("fp32", *[p for p in precisions if p != "fp32"]):
        if precision != "fp32" and not feeds:
            continue
        say(f"  {stage.name}: compiling {precision} ...")
        config = CompileConfig(engine=backend, precision=precision,
                               calib=str(calib) if precision == "int8" else None)  # fmt: skip
        dest = work / f"{stage.name}-{precision}.kiln"
        try:
            rounds = TIMING.rounds if config.is_auto else 0  # the stages are timed below
            kiln.compile(stage.source, dest, config=config, inputs=example, force=True,
                         rounds=rounds)  # fmt: skip
        except KilnError as exc:
            if precision == "fp32":
                raise KilnError(f"model {stage.name!r}: {exc}") from None
            stage.refused[precision] = str(exc)
            say(f"  {stage.name}: {precision} refused by its own check: {exc}")
            continue
        stage.candidates[precision] = dest


def _calibration_dir(feeds: list[dict[str, np.ndarray]], where: Path) -> Path:
    """Up to CALIB_SAMPLES recorded feeds, evenly spread over the run, one .npz each."""
    where.mkdir(parents=True)
    step = max(1, len(feeds) // CALIB_SAMPLES)
    for i, sample in enumerate(feeds[::step][:CALIB_SAMPLES]):
        np.savez(where / f"{i:04d}.npz", **sample)
    return where


def _order(reference: Recording, stages: Mapping[str, Stage]) -> list[str]:
    spent = reference.model_seconds()
    return sorted(stages, key=lambda name: -spent.get(name, 0.0))


def _space(stages: Mapping[str, Stage]) -> dict[str, Any]:
    return {
        name: {"candidates": sorted(s.candidates), "refused": s.refused}
        for name, s in stages.items()
    }


def _search(
    fn: PipelineFunction, stages: dict[str, Stage], inputs: list[Any], reference: Recording,
    score: Metric, top: float, max_drop: float, say: Say,
) -> tuple[list[Trial], float]:  # fmt: skip
    """Greedy over stages by their share of the time; each lossy candidate judged end to end,
    the fastest one that holds the metric and pays kept."""
    start = time.perf_counter()
    trials: list[Trial] = []
    spent = reference.model_seconds()
    for name in _order(reference, stages):
        stage = stages[name]
        mine: list[Trial] = []
        for precision in [p for p in stage.candidates if p != "fp32"]:
            choice = {n: s.choice for n, s in stages.items()} | {name: precision}
            value = score(reference.results, _run(fn, stages, choice, inputs).results)
            pace = stage_speedup(stage, precision, reference)
            baseline_ms = 1e3 * spent.get(name, 0.0)
            mine.append(Trial(
                name, precision, value, top - value, False, baseline_ms / max(pace.value, 1e-9),
                baseline_ms, _rejection(top - value, max_drop, pace), pace.value, pace.verdict,
            ))  # fmt: skip
        eligible = [t for t in mine if not t.reason]
        if eligible:
            best = max(eligible, key=lambda t: t.speedup)
            best.kept, stage.choice = True, best.precision
            for other in eligible:
                if other is not best:
                    other.reason = f"{best.precision} was faster ({best.speedup:.2f}x)"
        for t in mine:
            verdict = "kept" if t.kept else f"rejected: {t.reason}"
            say(f"  {name} {t.precision}: metric {t.metric:.4g} (reference {top:.4g}), "
                f"{t.speedup:.2f}x the stage's fp32 → {verdict}")  # fmt: skip
        trials += mine
    return trials, time.perf_counter() - start


def _final_check(
    fn: PipelineFunction, stages: dict[str, Stage], inputs: list[Any], reference: Recording,
    score: Metric, top: float, max_drop: float, say: Say,
) -> float:  # fmt: skip
    """The pipeline with every stage at its choice, run as it will run (kiln.Session over each
    artifact) and judged as the trials were: each artifact passed its own model's check on
    one input, which cannot see a stage that answers wrong on others, or only once open as a
    session. Returns the metric; refuses the build past the budget."""
    say("checking the compiled pipeline end to end ...")
    choice = {name: stage.choice for name, stage in stages.items()}
    value = score(reference.results, _run(fn, stages, choice, inputs).results)
    if top - value > max_drop:
        raise KilnError(
            f"the compiled pipeline's metric is {value:.4g} against the fp32 pipeline's "
            f"{top:.4g} (allowed drop {max_drop:.4g}), though every stage passed its own check "
            f"(choices: {', '.join(f'{n} {p}' for n, p in choice.items())}); nothing was "
            "written. Compile with --backend ort to rule out an engine, and report it."
        )
    return value


def _rejection(drop: float, max_drop: float, pace: Speedup) -> str:
    """Why a lossy candidate is not kept ("" if it is): it moved the pipeline's results past
    the budget, or it is not faster than the choice it would replace, beyond the timing's
    noise — a lossy choice must pay."""
    if drop > max_drop:
        return f"the metric fell {drop:.4g} (allowed {max_drop:.4g})"
    if pace.verdict == SLOWER:
        return f"slower: {pace.value:.2f}x the stage's current choice"
    if pace.verdict != FASTER:
        rounds = (f" (rounds {pace.spread[0]:.2f}-{pace.spread[1]:.2f})"
                  if pace.spread else "")  # fmt: skip
        return f"not faster: {pace.value:.2f}x the stage's current choice{rounds}, {pace.verdict}"
    return ""


def stage_speedup(stage: Stage, precision: str, reference: Recording) -> Speedup:
    """The stage at `precision` against its current choice, timed interleaved (kiln.timing)
    on the feeds it received in the reference run (up to TIMED_CALLS of them, spread over it):
    above 1, the candidate is faster."""
    from kiln.runtime import Session

    feeds = reference.feeds(stage.name)
    sample = feeds[:: max(1, len(feeds) // TIMED_CALLS)][:TIMED_CALLS]
    sessions = {p: Session(str(stage.candidates[p])) for p in (stage.choice, precision)}
    try:
        runners = {p: _replay(s, sample) for p, s in sessions.items()}
        rounds = interleave(runners, rounds=TIMED_ROUNDS, runs=1, warmup=1)
    finally:
        for session in sessions.values():
            session.close()
    return speedup(rounds[stage.choice], rounds[precision])


def _replay(session: Any, sample: list[dict[str, np.ndarray]]) -> Callable[[], None]:
    def run() -> None:
        for feeds in sample:
            session.run(None, feeds)

    return run


def _run(fn: PipelineFunction, stages: Mapping[str, Stage], choice: Mapping[str, str],
         inputs: list[Any]) -> Recording:  # fmt: skip
    from kiln.runtime import Session

    sessions = {n: Session(str(stages[n].candidates[p])) for n, p in choice.items()}
    try:
        return record(fn, sessions, inputs)
    finally:
        for session in sessions.values():
            session.close()


def _reference_json(reference: Recording, inputs: int) -> dict[str, Any]:
    shapes = {
        model: {name: {"x".join(map(str, s)): n for s, n in counts.most_common(16)}
                for name, counts in reference.shapes(model).items()}
        for model in {call.model for call in reference.calls}
    }  # fmt: skip
    return {
        "inputs": inputs,
        "seconds": round(sum(reference.seconds), 4),
        "model_seconds": {k: round(v, 4) for k, v in reference.model_seconds().items()},
        "glue_seconds": round(reference.glue_seconds(), 4),
        "calls": {m: len(reference.of(m)) for m in {c.model for c in reference.calls}},
        "shapes": shapes,
    }
