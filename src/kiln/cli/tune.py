"""`kiln tune`: search every decision (engine, precision, passes, runtime options) with
Optuna, measured honestly against the incumbent; the pick confirmed and written."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated

import typer

from kiln.cli.console import JsonOpt, check_output, console, emit_json, err, progress
from kiln.errors import KilnError

_UNITS = {"": 1, "s": 1, "m": 60, "min": 60, "h": 3600}


def parse_duration(text: str) -> float:
    """'15m', '90s', '1h', '300' (seconds) → seconds."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|m|min|h)?\s*", text)
    if not match:
        raise KilnError(f"--time {text}: expected a duration such as 90s, 15m or 1h.")
    seconds = float(match.group(1)) * _UNITS[match.group(2) or ""]
    if seconds <= 0:
        raise KilnError(f"--time {text}: give a positive duration, e.g. --time 15m.")
    return seconds


def tune(
    model: Annotated[
        str,
        typer.Argument(
            help="An .onnx file, a .pt2 saved by torch.export.save (needs PyTorch; verified on "
            "its saved example inputs), zoo:NAME, or an artifact NAME.kiln (the source model "
            "its manifest records is tuned)."
        ),
    ],
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="Write the tuned artifact here.")
    ] = None,
    objective: Annotated[
        list[str],
        typer.Option(
            help="latency (P50), p99, jitter ((P99−P50)/P50), throughput (samples/s, batch and "
            "concurrency searched too) or memory; repeat (or comma-separate) for a Pareto "
            "front, the first one picks."
        ),
    ] = ["latency"],  # noqa: B006
    max_p50: Annotated[
        str | None, typer.Option(help="Constraint with its unit (us, ms, s), e.g. 20ms.")
    ] = None,
    max_p99: Annotated[
        str | None, typer.Option(help="Constraint with its unit (us, ms, s), e.g. 50ms.")
    ] = None,
    max_jitter: Annotated[str | None, typer.Option(help="Constraint, e.g. 0.2.")] = None,
    max_memory: Annotated[
        str | None,
        typer.Option(
            help="Constraint on the session's peak resident memory (measured in a process of "
            "its own), with its unit (kB, MB, GB decimal; KiB, MiB, GiB binary), e.g. 2GiB."
        ),
    ] = None,
    min_throughput: Annotated[str | None, typer.Option(help="Constraint (samples/s).")] = None,
    clients: Annotated[
        int,
        typer.Option(
            help="With --objective throughput: measure it served to this many concurrent "
            "clients, each sending one-sample requests through the dynamic batcher, and search "
            "the batcher's max batch and delay (kiln serve --max-batch/--max-delay-ms, which "
            "serve then takes from the artifact) instead of batch and streams."
        ),
    ] = 0,
    traffic: Annotated[
        str | None,
        typer.Option(
            help="With --clients: the request shapes production sends, as JSON (a file, or the "
            "JSON itself) — a list of requests giving each dynamic dim a size, e.g. "
            '\'[{"seq": 12}, {"batch": 4, "seq": 128}]\' (batch defaults to 1) — or '
            "served:NAME, the shapes kiln serve --feedback "
            "recorded for NAME. The clients replay them through a kiln.Session, and "
            "the bucket sets proposed from them (0–8 sizes per dim) are searched too; the "
            "pick's set is written into the artifact, where kiln serve takes it."
        ),
    ] = None,
    trials: Annotated[int, typer.Option(help="Finished trials the study should hold.")] = 30,
    time: Annotated[
        str | None,
        typer.Option(
            "--time",
            help="The whole command's time, confirmation included, e.g. 15m: trials start "
            "until a quarter of it (at most 30 s) is left, which the confirmation then uses.",
        ),
    ] = None,
    storage: Annotated[
        str | None,
        typer.Option(
            help="Study and strategy-library database URL (default: sqlite under KILN_HOME; "
            "postgresql+psycopg://... shares one study between machines)."
        ),
    ] = None,
    study: Annotated[
        str | None,
        typer.Option(help="Study name (default: MODEL-OBJECTIVE-HARDWARE); reuse it to resume."),
    ] = None,
    workers: Annotated[int, typer.Option(help="Worker processes sharing the study.")] = 1,
    stale_after: Annotated[
        int,
        typer.Option(
            help="Seconds without a heartbeat after which a worker's trial is failed and "
            "retried by the others (a crashed or killed worker)."
        ),
    ] = 60,
    backend: Annotated[
        str | None, typer.Option(help="Engines to search, e.g. ort,openvino (default: all).")
    ] = None,
    precision: Annotated[
        str | None,
        typer.Option(help="Precisions to search, e.g. fp32,int8 (default: all)."),
    ] = None,
    metric: Annotated[str, typer.Option(help="Accuracy metric, as in optimize.")] = "cosine",
    max_drop: Annotated[float, typer.Option(help="Accuracy budget, as in optimize.")] = 0.01,
    calib: Annotated[str | None, typer.Option(help="Calibration samples, as in optimize.")] = None,
    inputs: Annotated[str | None, typer.Option(help="Reference inputs (.npz).")] = None,
    shape: Annotated[list[str], typer.Option(help="INPUT=D0xD1..., as in optimize.")] = [],  # noqa: B006
    seconds_per_trial: Annotated[
        float, typer.Option(help="Measuring time per trial (s), beyond building it.")
    ] = 3.0,
    confirm_runs: Annotated[
        int, typer.Option(help="Runs of the final tuned-vs-defaults confirmation, each side.")
    ] = 1000,
    warm_start: Annotated[
        bool, typer.Option(help="Start from the winners of the nearest models in the library.")
    ] = True,
    seed: Annotated[
        int | None, typer.Option(help="Sampler seed (reproducible suggestions).")
    ] = None,
    report: Annotated[
        Path | None,
        typer.Option(
            help="Write a self-contained HTML report here: every trial with its configuration "
            "and measures, the best so far, the Pareto front, refused trials and why. "
            "optuna-dashboard on the same --storage browses the study live."
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Search every decision Kiln makes for MODEL on this machine (Optuna), each trial built,
    verified within the accuracy budget and timed interleaved against the best so far; the
    pick is re-confirmed against the defaults over 1,000+ runs and kept only when better.

    Studies live in --storage under --study: rerun the same command to resume one; run several
    workers (--workers, or machines on one PostgreSQL URL) to share it. Every finished study
    is remembered in the strategy library (kiln strategies) and warm-starts similar models.
    """
    from kiln.config import CompileConfig
    from kiln.ir.inputs import parse_shapes
    from kiln.tune.objectives import parse_constraint, parse_objectives
    from kiln.tune.study import plan_for
    from kiln.tune.study import tune as run_tune

    objectives = parse_objectives(objective)
    limits = {"max_p50": max_p50, "max_p99": max_p99, "max_jitter": max_jitter,
              "max_memory": max_memory, "min_throughput": min_throughput}  # fmt: skip
    constraints = [parse_constraint(k, v) for k, v in limits.items() if v is not None]
    if workers < 1:
        raise KilnError(f"--workers {workers}: use at least 1.")
    if seconds_per_trial <= 0:
        raise KilnError(f"--seconds-per-trial {seconds_per_trial:g}: give a positive time.")
    timeout = parse_duration(time) if time is not None else None
    check_output(report, "--report")
    base = CompileConfig(metric=metric, max_drop=max_drop, calib=calib, inputs=inputs,
                         shapes=parse_shapes(shape))  # fmt: skip
    plan = plan_for(
        model, objectives=objectives, constraints=constraints, base=base, trials=trials,
        timeout_s=timeout, url=storage, study=study, seconds_per_trial=seconds_per_trial,
        engines=_list(backend), precisions=_list(precision), seed=seed,
        confirm_runs=confirm_runs, stale_after_s=stale_after, clients=clients, traffic=traffic,
    )  # fmt: skip
    if output is not None:
        from kiln.artifact import check_destination

        check_destination(output)
    with progress() as bar:
        task = bar.add_task(f"tuning {model}")
        say = lambda msg: bar.update(task, description=msg)  # noqa: E731

        def on_trial(done: int, total: int, best: float | None) -> None:
            first = objectives[0]
            shown = f"{best:.4g} {first.unit}".strip() if best is not None else "none yet"
            say(f"trial {done}/{total}; best {first.name} so far {shown}")

        result = run_tune(plan, output, workers=workers, say=say, on_trial=on_trial,
                          warm_start=warm_start).to_json()  # fmt: skip
    if report is not None:
        from kiln.report.tune import write_tune_html

        write_tune_html(result, [o.name for o in objectives], report)
    if as_json:
        emit_json(result)
        return
    from kiln.report.tune import print_tune

    print_tune(result, console)
    if report is not None:
        err.print(f"report: {report}", highlight=False)


def _list(text: str | None) -> list[str] | None:
    return [w.strip() for w in text.split(",") if w.strip()] if text else None
