"""`kiln.tune.tune`: an Optuna study over `kiln.tune.space`, each trial built, verified and
measured against the incumbent (`kiln.tune.bench`); the pick re-confirmed against the defaults
over ≥ 1,000 runs, written as an artifact and remembered in the strategy library.

A study lives in the storage (`kiln.tune.storage`) under its name, so an interrupted run
resumes it and several workers — processes here, or machines on one PostgreSQL — share it.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.backends import available_backends
from kiln.compiler.api import load_source, save_result
from kiln.compiler.torch_check import EXAMPLE
from kiln.config import ENGINES, PRECISIONS, CompileConfig, read_config
from kiln.errors import KilnError
from kiln.ir.inputs import read_inputs
from kiln.ir.load import LoadedModel
from kiln.tune.bench import Measured, Refused, Workbench, batch_dim
from kiln.tune.confirm import CONFIRM_RUNS, confirm, verdict
from kiln.tune.library import Library, Record
from kiln.tune.objectives import Constraint, Objective
from kiln.tune.seeds import enqueue_seeds
from kiln.tune.signature import content_digest, hardware, model_signature
from kiln.tune.space import Space, choice_of, default_params, project, suggest
from kiln.tune.storage import (
    GRACE_S,
    HEARTBEAT_S,
    create_study,
    default_url,
    fail_dead_trials,
    fail_silent_trials,
    optuna_storage,
    safe_url,
)
from kiln.tune.traffic import Shape, check_traffic, load_traffic

Say = Callable[[str], None]
FINISHED = ("COMPLETE", "PRUNED")
DEFAULTS_BEST = "the defaults measured best"
CONFIRM_SHARE = 0.25  # of --time, kept for the confirmation: trials start until it is left


@dataclass
class Plan:
    """Everything a worker needs to join a study (picklable: workers are processes)."""

    source: str
    base: CompileConfig
    objectives: list[Objective]
    constraints: list[Constraint]
    engines: list[str]
    precisions: list[str]
    trials: int
    seconds_per_trial: float
    url: str
    study: str
    timeout_s: float | None = None  # --time: the whole command, confirmation included
    deadline: float | None = None  # time.time() by which it ends (set when tuning starts)
    seed: int | None = None
    heartbeat_s: int = HEARTBEAT_S
    grace_s: int = GRACE_S
    confirm_seconds: float = 30.0  # to tighten the interval, once confirm_runs are done
    confirm_runs: int = CONFIRM_RUNS
    clients: int = 0  # throughput served to this many clients through the batcher
    traffic: list[Shape] | None = None  # served: request shapes to replay; bucket sets searched


@dataclass
class TuneResult:
    study: str
    storage: str
    trials: dict[str, int]  # by state
    pick: dict[str, Any]  # params, config, measures
    defaults: dict[str, Any]
    gains: dict[str, Any]  # the confirmation: tuned vs defaults, with intervals
    changed: dict[str, tuple[Any, Any]]  # knob → (default, tuned)
    pareto: list[dict[str, Any]]
    warm_start: list[str]
    artifact: str | None = None
    library_id: int | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    importances: dict[str, float] = field(default_factory=dict)
    objectives: list[dict[str, str]] = field(default_factory=list)  # name, unit, direction

    def to_json(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def tune(plan: Plan, output: str | os.PathLike | None, workers: int = 1, say: Say = print,
         on_trial: Callable[[int, int, float | None], None] | None = None,
         warm_start: bool = True) -> TuneResult:  # fmt: skip
    import optuna

    if plan.timeout_s is not None and plan.deadline is None:
        plan.deadline = time.time() + plan.timeout_s
    loaded = load_source(plan.source)
    _traffic(plan, loaded)  # refused before the study exists
    space = _space(plan)
    storage = optuna_storage(plan.url, plan.heartbeat_s, plan.grace_s)
    library = Library(plan.url)
    signature, machine = model_signature(loaded.model), hardware()
    study = _study(plan, storage)
    objective_name = "+".join(o.name for o in plan.objectives)

    def nearest() -> list:
        return library.nearest(signature, machine["class"], objective_name) if warm_start else []

    more = _remaining(study, plan.trials) > 0
    warm = enqueue_seeds(study, space, loaded.model, plan.base, storage, plan.url, nearest, more)
    if warm:
        say(f"warm start from the winners of {', '.join(warm)}")
    bench = _workbench(plan, loaded, say)
    _run(plan, study, workers, say, on_trial, bench)
    study = optuna.load_study(study_name=plan.study, storage=storage)
    _wait_for_others(study, plan, say)
    pick, pareto = _pick(study, plan)
    return _finish(plan, loaded, space, bench, study, pick, pareto, output, library,
                   signature, machine, warm, say)  # fmt: skip


def _space(plan: Plan) -> Space:
    throughput = any(o.measure == "throughput" for o in plan.objectives) or any(
        c.measure == "throughput" for c in plan.constraints
    )
    memory = any(o.measure == "memory_mib" for o in plan.objectives) or any(
        c.measure == "memory_mib" for c in plan.constraints
    )
    return Space.for_model(plan.engines, plan.precisions, throughput, plan.clients,
                           buckets=bool(plan.traffic), memory=memory)  # fmt: skip


def _traffic(plan: Plan, loaded: LoadedModel) -> list[Shape] | None:
    """The plan's traffic checked against the model (every request sized on its dims)."""
    if not plan.traffic:
        return None
    return check_traffic(plan.traffic, loaded.model, batch_dim(loaded.model))


def _study(plan: Plan, storage: Any) -> Any:
    clash = (f"study '{plan.study}' exists with other objectives; choose another --study name "
             "or the same --objective.")  # fmt: skip
    return create_study(storage, plan.study, [o.direction for o in plan.objectives],
                        trials=plan.trials, seed=plan.seed, clash=clash,
                        constraints=_violations if plan.constraints else None)  # fmt: skip


def _violations(trial: Any) -> list[float]:
    return list(trial.user_attrs.get("violations", [0.0]))


def _workbench(plan: Plan, loaded: LoadedModel, say: Say = lambda _m: None) -> Workbench:
    given, source = None, "given inputs"
    if plan.base.inputs:
        given, source = [read_inputs(plan.base.inputs, loaded.model)], plan.base.inputs
    elif loaded.example is not None:  # a .pt2: verified on its saved example, as optimize
        given, source = [loaded.example.feeds], EXAMPLE
    return Workbench(loaded, plan.base, plan.objectives, plan.constraints,
                     plan.seconds_per_trial, given, source, say,
                     traffic=_traffic(plan, loaded))  # fmt: skip


def objective_function(plan: Plan, loaded: LoadedModel, bench: Workbench) -> Callable:
    import optuna

    space = _space(plan)

    def objective(trial: Any) -> tuple[float, ...]:
        choice = suggest(trial, space, loaded.model, plan.base)
        same = _measured_before(trial)
        if same is not None:  # nothing measured twice by accident
            trial.set_user_attr("duplicate_of", same.number)
            for key in ("measures", "violations", "config"):
                trial.set_user_attr(key, same.user_attrs.get(key))
            return tuple(same.values)
        twin = _measuring_now(trial)
        if twin is not None:  # e.g. two workers both retried a dead worker's trial
            trial.set_user_attr("duplicate_of", twin.number)
            raise optuna.TrialPruned(f"trial {twin.number} measures this configuration")
        try:
            measured = bench.measure(bench.build(choice))
        except (Refused, KilnError) as exc:
            trial.set_user_attr("refused", str(exc))
            raise optuna.TrialPruned(str(exc)) from None
        trial.set_user_attr("measures", measured.measures)
        trial.set_user_attr("evidence", measured.evidence)
        trial.set_user_attr("config", choice.config.to_json())
        trial.set_user_attr(
            "violations", [c.violation(measured.measures) for c in plan.constraints] or [0.0]
        )
        return tuple(measured.measures[o.measure] for o in plan.objectives)

    return objective


def _measured_before(trial: Any) -> Any:
    import optuna

    done = trial.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    return next((t for t in done if t.params == trial.params), None)


def _measuring_now(trial: Any) -> Any:
    """An earlier trial with the same parameters that another worker is running now."""
    import optuna

    running = trial.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
    return next((t for t in running if t.number < trial.number and t.params == trial.params), None)


def _remaining(study: Any, trials: int) -> int:
    import optuna

    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    return trials - len(study.get_trials(deepcopy=False, states=states))


def _run(
    plan: Plan, study: Any, workers: int, say: Say, on_trial: Callable | None, bench: Workbench
) -> None:
    if _remaining(study, plan.trials) <= 0:
        say(f"study '{plan.study}' already has {plan.trials} finished trials")
        return
    remaining = _remaining(study, plan.trials)
    if workers <= 1:
        run_worker(plan, remaining, on_trial=on_trial, bench=bench)
        return
    # Each worker runs its share exactly: a worker that counted the study's trials itself
    # could start one more while another is between trials (a race the shares cannot have).
    shares = [remaining // workers + (i < remaining % workers) for i in range(workers)]
    context = multiprocessing.get_context("spawn")
    processes = [
        context.Process(target=run_worker, args=(plan, share)) for share in shares if share
    ]
    for process in processes:
        process.start()
    try:
        while any(p.is_alive() for p in processes):
            if on_trial is not None:
                _report(study, plan, on_trial)
            time.sleep(1.0)
    finally:
        for process in processes:
            process.join(timeout=5)
            if process.is_alive():
                process.terminate()


def run_worker(
    plan: Plan, share: int, on_trial: Callable | None = None, bench: Workbench | None = None
) -> None:
    """One worker: join the study and run `share` trials (a retried trial of a dead worker
    among them), or fewer when the study has `plan.trials` finished and running ones (other
    machines' workers count) or `plan.timeout_s` is spent. Also the entry of worker
    processes."""
    import optuna

    storage = optuna_storage(plan.url, plan.heartbeat_s, plan.grace_s)
    study = optuna.load_study(study_name=plan.study, storage=storage,
                              sampler=_study(plan, storage).sampler)  # fmt: skip
    loaded = bench.loaded if bench is not None else load_source(plan.source)
    bench = bench or _workbench(plan, loaded)
    callbacks = [_enough(plan.trials)]
    if on_trial is not None:
        callbacks.append(lambda s, _t: _report(s, plan, on_trial))
    timeout = _trials_left_s(plan)
    fail_silent_trials(study)  # a dead worker's trial is retried, not counted as running
    if _remaining(study, plan.trials) > 0 and (timeout is None or timeout > 0):
        study.optimize(objective_function(plan, loaded, bench), n_trials=share,
                       timeout=timeout, callbacks=callbacks)  # fmt: skip


def _trials_left_s(plan: Plan) -> float | None:
    """Seconds in which trials may still start: --time, less the share kept to confirm."""
    if plan.deadline is None or plan.timeout_s is None:
        return None
    keep = min(plan.confirm_seconds, CONFIRM_SHARE * plan.timeout_s)
    return plan.deadline - keep - time.time()


def _left_s(plan: Plan) -> float | None:
    """Seconds left of --time (None: no --time)."""
    return None if plan.deadline is None else max(0.0, plan.deadline - time.time())


def _wait_for_others(study: Any, plan: Plan, say: Say) -> None:
    """Trials that other workers (commands, machines) are still measuring count towards the
    pick: wait for them, as `--workers N` waits for its own processes. A dead worker's trial
    is failed once silent for --stale-after (then it no longer runs)."""
    import optuna

    while True:
        running = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,))
        left = _left_s(plan)
        if not running or (left is not None and left <= 0):
            return
        say(f"waiting for {len(running)} trial{'s' * (len(running) > 1)} other workers "
            "are measuring")  # fmt: skip
        fail_dead_trials(study)
        time.sleep(1.0)


def _enough(trials: int) -> Callable[[Any, Any], None]:
    """Stop this worker when the finished trials and those other workers are running make
    `trials`: counting only finished ones (Optuna's MaxTrialsCallback) lets every worker start
    one more at the end."""
    import optuna

    states = (
        optuna.trial.TrialState.COMPLETE,
        optuna.trial.TrialState.PRUNED,
        optuna.trial.TrialState.RUNNING,
    )

    def callback(study: Any, _trial: Any) -> None:
        fail_silent_trials(study)
        if len(study.get_trials(deepcopy=False, states=states)) >= trials:
            study.stop()

    return callback


def _report(study: Any, plan: Plan, on_trial: Callable) -> None:
    finished = plan.trials - _remaining(study, plan.trials)
    best = _best_value(study, plan)
    on_trial(finished, plan.trials, best)


def _best_value(study: Any, plan: Plan) -> float | None:
    values = [t.values[0] for t in _feasible(study, plan)]
    if not values:
        return None
    return min(values) if plan.objectives[0].direction == "minimize" else max(values)


def violations(trial: Any, plan: Plan) -> list[float]:
    """How far the trial's measures are outside the limits given *now* (≤ 0: met): a resumed
    study may have measured its trials under other limits, or none. A measure the trial
    never took (a limit new to the study) is not met."""
    measures = trial.user_attrs.get("measures") or {}
    return [c.violation(measures) if c.measure in measures else float("inf")
            for c in plan.constraints]  # fmt: skip


def _feasible(study: Any, plan: Plan) -> list[Any]:
    import optuna

    done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    return [t for t in done if all(v <= 0 for v in violations(t, plan))]


def _pick(study: Any, plan: Plan) -> tuple[Any, list[Any]]:
    feasible = _feasible(study, plan)
    if not feasible:
        raise KilnError(_nothing_met(study, plan))
    first = plan.objectives[0]
    sign = 1 if first.direction == "minimize" else -1
    front = _pareto(feasible, plan.objectives)
    return min(front, key=lambda t: sign * t.values[0]), front


def _pareto(trials: list[Any], objectives: list[Objective]) -> list[Any]:
    signs = [1 if o.direction == "minimize" else -1 for o in objectives]

    def dominates(a: Any, b: Any) -> bool:
        pairs = [(s * x, s * y) for s, x, y in zip(signs, a.values, b.values, strict=True)]
        return all(x <= y for x, y in pairs) and any(x < y for x, y in pairs)

    return [t for t in trials if not any(dominates(o, t) for o in trials)]


def _nothing_met(study: Any, plan: Plan) -> str:
    import optuna

    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    trials = study.get_trials(deepcopy=False, states=states)  # run ones: waiting never ran
    refused = [t.user_attrs["refused"] for t in trials if "refused" in t.user_attrs]
    over = sum(
        1 for t in trials
        if t.state == optuna.trial.TrialState.COMPLETE and any(v > 0 for v in violations(t, plan))
    )  # fmt: skip
    why = []
    if refused:
        why.append(f"{len(refused)} refused (first: {refused[0]})")
    if over:
        limits = ", ".join(c.text for c in plan.constraints)
        why.append(f"{over} measured outside {limits}")
    if not trials:
        why.append("none ran" + (" within --time" if plan.timeout_s is not None else ""))
    return (
        f"no configuration met the budget in {len(trials)} finished trial"
        f"{'s' * (len(trials) != 1)} of study '{plan.study}'"
        f"{': ' + '; '.join(why) if why else ''}. Loosen --max-drop or the limits, or run more "
        "--trials (the study is kept and resumes)."
    )


def _finish(plan, loaded, space, bench, study, pick, pareto, output, library, signature,
            machine, warm, say) -> TuneResult:  # fmt: skip
    defaults = default_params(space)
    is_default = pick.params == project(defaults, space, loaded.model, plan.base)
    say(f"confirming trial {pick.number} against the defaults over {plan.confirm_runs}+ runs")
    tuned = bench.build(choice_of(pick.params, space, loaded.model, plan.base))
    base = tuned if is_default else bench.build(choice_of(defaults, space, loaded.model, plan.base))
    throughput = any(o.measure == "throughput" for o in plan.objectives)
    # The defaults against themselves need no tightening: their figures are for the table.
    # Nothing runs past --time; what the trials left of it is the confirmation's.
    left = _left_s(plan)
    seconds = 0.0 if is_default else plan.confirm_seconds
    throughput_s = plan.seconds_per_trial * 2 if throughput else None
    if left is not None:
        seconds = min(seconds, left)
        throughput_s = min(throughput_s, max(left - seconds, 0.5)) if throughput_s else None
    # Memory takes a process of its own per side: measured where the study is about it.
    gains = confirm(tuned, base, runs=plan.confirm_runs, seconds=seconds,
                    throughput_s=throughput_s, limit_s=left,
                    memory=bench.needs_memory)  # fmt: skip
    gains["measured"] = {"trial": pick.number, "engine": tuned.choice.config.engine,
                         "precision": tuned.choice.config.precision,
                         "changed": {k: [defaults.get(k), v] for k, v in pick.params.items()
                                     if defaults.get(k) != v}}  # fmt: skip
    # Two sessions of one configuration differ by ~1 % (layout, order): not a win to report.
    gains["verdict"] = DEFAULTS_BEST if is_default else verdict(plan.objectives[0], gains)
    if gains["verdict"] == DEFAULTS_BEST:
        say("the defaults measured best: they are kept")
    elif gains["verdict"] != "better":
        say(f"the pick is {gains['verdict']} than the defaults on {plan.objectives[0].name}: "
            "the defaults are kept")  # fmt: skip
        tuned, pick = base, None
    serving = tuned.choice.serving()
    if serving is not None:  # what `kiln serve` runs this artifact with
        gains["serving"] = serving | ({"buckets": tuned.buckets} if plan.traffic else {})
    artifact = None
    if output is not None:  # the bucket set goes where every kiln.Session reads it
        artifact = str(save_result(tuned.result, output, {"tune": gains},
                                   buckets=tuned.buckets).path)  # fmt: skip
    params = pick.params if pick is not None else defaults
    changed = {k: (defaults.get(k), v) for k, v in params.items() if defaults.get(k) != v}
    front = [{"trial": t.number, "values": list(t.values), "params": t.params} for t in pareto]
    objective_name = "+".join(o.name for o in plan.objectives)
    record = Record(
        kind="study", hardware=machine, model=loaded.name, signature=signature,
        objective=objective_name, params=params, config=tuned.result.config.to_json(),
        gains=gains, pareto=front, evidence={"study": plan.study, "trials": len(study.trials)},
    )  # fmt: skip
    record_id = library.add(record)
    return TuneResult(
        study=plan.study, storage=safe_url(plan.url), trials=_states(study),
        pick={
            "trial": pick.number if pick else None, "params": params,
            "values": list(pick.values) if pick else None,
            "config": tuned.result.config.to_json(),
            "measures": pick.user_attrs.get("measures") if pick else None,
        },
        defaults={"params": defaults}, gains=gains, changed=changed, pareto=front,
        warm_start=warm, artifact=artifact, library_id=record_id,
        history=[_history(t, plan) for t in study.trials],
        importances=_importances(study),
        objectives=[{"name": o.name, "unit": o.unit, "direction": o.direction}
                    for o in plan.objectives],
    )  # fmt: skip


def _history(trial: Any, plan: Plan) -> dict[str, Any]:
    """One trial as the report lists it: what it tried, what it measured, and why it was
    refused, outside the limits or a duplicate."""
    attrs = trial.user_attrs
    outside = [c.text for c, v in zip(plan.constraints, violations(trial, plan), strict=True)
               if v > 0] if trial.state.name == "COMPLETE" else []  # fmt: skip
    return {"trial": trial.number, "state": trial.state.name, "values": trial.values,
            "params": trial.params, "refused": attrs.get("refused"),
            "duplicate_of": attrs.get("duplicate_of"), "measures": attrs.get("measures"),
            "outside": outside}  # fmt: skip


def _importances(study: Any) -> dict[str, float]:
    """How much each knob moved the first objective (Optuna's fANOVA); {} when too few
    trials differ to say."""
    import optuna

    done = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    if len({tuple(sorted(t.params.items())) for t in done}) < 3:
        return {}  # too few to say; and fANOVA's import (scikit-learn) alone takes seconds
    try:
        found = optuna.importance.get_param_importances(study, target=lambda t: t.values[0])
    except (ValueError, RuntimeError, ZeroDivisionError):
        return {}
    return {k: float(v) for k, v in found.items()}


def _states(study: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for t in study.get_trials(deepcopy=False):
        counts[t.state.name] = counts.get(t.state.name, 0) + 1
    return counts


def resolve_source(source: str) -> str:
    """The model a study tunes: a .pt2, an .onnx or zoo:NAME as given; for an artifact
    (NAME.kiln) the source model its manifest records (as `kiln optimize --config` finds
    it), since a tuned artifact is rebuilt from its source, not from its compiled graph."""
    path = Path(source)
    if not path.is_dir():
        return source
    if not (path / "manifest.json").is_file():
        raise KilnError(f"{source} is a directory but not a Kiln artifact (no manifest.json); "
                        "give an .onnx, a .pt2, zoo:NAME or an artifact NAME.kiln.")  # fmt: skip
    _config, recorded = read_config(path)
    if not recorded or recorded.startswith("<"):
        raise KilnError(f"{source}: its manifest records no source model file to tune "
                        f"({recorded or 'none'}); give the model itself.")  # fmt: skip
    if not recorded.startswith("zoo:") and not Path(recorded).exists():
        raise KilnError(f"{source} was built from {recorded}, which is no longer there; give "
                        "the model itself.")  # fmt: skip
    return recorded


def plan_for(
    source: str, *, objectives: list[Objective], constraints: list[Constraint],
    base: CompileConfig, trials: int, timeout_s: float | None, url: str | None,
    study: str | None, engines: list[str] | None = None, precisions: list[str] | None = None,
    seconds_per_trial: float = 3.0, seed: int | None = None, confirm_runs: int = CONFIRM_RUNS,
    stale_after_s: int = GRACE_S, clients: int = 0, traffic: str | os.PathLike | None = None,
) -> Plan:  # fmt: skip
    """A Plan with Kiln's defaults filled in; bad values are refused here, before any work."""
    if trials < 1:
        raise KilnError(f"--trials {trials}: give 1 or more.")
    if stale_after_s < 2:
        raise KilnError(f"--stale-after {stale_after_s}: give 2 seconds or more.")
    if confirm_runs < 1:
        raise KilnError(f"--confirm-runs {confirm_runs}: give 1 or more.")
    if clients < 0:
        raise KilnError(f"--clients {clients}: give 0 (offline throughput) or more.")
    if clients and not any(o.measure == "throughput" for o in objectives):
        raise KilnError("--clients measures served throughput: add --objective throughput.")
    if traffic is not None and not clients:
        raise KilnError("--traffic is replayed by served clients: add --clients N.")
    url = url or default_url()
    source = resolve_source(source)
    if base.shapes and not source.endswith(".pt2"):  # a wrong --shape name: before the search
        from kiln.ir.inputs import bind_dims
        from kiln.ir.load import load_model

        bind_dims(load_model(source).model, {}, dict(base.shapes))
    shapes = load_traffic(traffic, url) if traffic is not None else None
    if timeout_s is not None and timeout_s <= 0:
        raise KilnError(f"--time {timeout_s:g}s: give a positive duration, e.g. --time 15m.")
    installed = [e for e in available_backends() if e in ENGINES]
    engines = engines or installed
    missing = [e for e in engines if e not in installed]
    if missing:
        raise KilnError(f"engine {missing[0]} is not installed; installed: {', '.join(installed)}.")
    unknown = [p for p in precisions or [] if p not in PRECISIONS]
    if unknown:
        raise KilnError(f"unknown precision '{unknown[0]}'; use {', '.join(PRECISIONS)}.")
    name = Path(source).stem if not source.startswith("zoo:") else source[4:]
    name += content_digest(source)  # two models of one file name are two studies
    objective = "+".join(o.name for o in objectives) + (f"-served{clients}" if clients else "")
    if shapes:  # another traffic is another study: its bucket sets answer other shapes
        digest = hashlib.sha256(json.dumps(shapes, sort_keys=True).encode()).hexdigest()
        objective += f"-traffic{digest[:8]}"
    return Plan(
        source=source, base=base, objectives=objectives, constraints=constraints,
        engines=engines, precisions=list(precisions or PRECISIONS), trials=trials,
        seconds_per_trial=seconds_per_trial, url=url,
        study=study or f"{name}-{objective}-{hardware()['class'][:8]}", timeout_s=timeout_s,
        seed=seed, confirm_runs=confirm_runs, grace_s=stale_after_s,
        heartbeat_s=max(1, min(HEARTBEAT_S, stale_after_s // 4)), clients=clients,
        traffic=shapes,
    )  # fmt: skip


__all__ = ["Measured", "Plan", "TuneResult", "plan_for", "run_worker", "tune"]
