"""`kiln tune`: search every decision (engine, precision, passes, runtime options) with
Optuna, measured honestly against the incumbent; the pick confirmed and written."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from kiln.cli.console import (
    JsonOpt,
    check_output,
    console,
    duration,
    emit_json,
    err,
    progress,
)
from kiln.cli.flags import Flag, command, options
from kiln.config import CompileConfig
from kiln.tune.plan import TuneConfig

ModelArg = Annotated[
    str,
    typer.Argument(
        help="An .onnx file, a .pt2 saved by torch.export.save (needs PyTorch; verified on "
        "its saved example inputs), zoo:NAME, or an artifact NAME.kiln (the source model "
        "its manifest records is tuned)."
    ),
]
OutputOpt = Annotated[
    Path | None, typer.Option("-o", "--output", help="Write the tuned artifact here.")
]
ReportOpt = Annotated[
    Path | None,
    typer.Option(
        help="Write a self-contained HTML report here: every trial with its configuration "
        "and measures, the best so far, the Pareto front, refused trials and why. "
        "optuna-dashboard on the same --storage browses the study live."
    ),
]


def _words(text: str | None) -> tuple[str, ...] | None:
    """ "ort,openvino" → ("ort", "openvino")."""
    return tuple(w.strip() for w in text.split(",") if w.strip()) if text else None


def _shapes(given: list[str]) -> dict[str, tuple[int, ...]]:
    from kiln.ir.inputs import parse_shapes

    return parse_shapes(given)


TUNE_FLAGS = options(TuneConfig, panel="The search (TuneConfig)", flags={
    "objective": Flag(type=list[str], default=["latency"], parse=tuple),
    "seconds": Flag(names=("--time",), type=str | None, parse=duration),
    "engines": Flag(names=("--backend",), type=str | None, parse=_words),
    "precisions": Flag(names=("--precision",), type=str | None, parse=_words),
})  # fmt: skip
# The compile decisions every trial keeps; the search varies the others.
BASE_FLAGS = options(
    CompileConfig, "metric", "max_drop", "calib", "inputs", "shapes",
    panel="Every trial (CompileConfig)",
    flags={"shapes": Flag(names=("--shape",), type=list[str], default=[], parse=_shapes)},
)  # fmt: skip


@command
def tune(
    model: ModelArg, output: OutputOpt = None, config: Any = TUNE_FLAGS, base: Any = BASE_FLAGS,
    report: ReportOpt = None, as_json: JsonOpt = False,
) -> None:  # fmt: skip
    """Search every decision Kiln makes for MODEL on this machine (Optuna), each trial built,
    verified within the accuracy budget and timed interleaved against the best so far; the
    pick is re-confirmed against the defaults over 1,000+ runs and kept only when better.

    Studies live in --storage under --study: rerun the same command to resume one; run several
    workers (--workers, or machines on one PostgreSQL URL) to share it. Every finished study
    is remembered in the strategy library (kiln strategies) and warm-starts similar models.
    """
    from kiln.tune.plan import plan_of
    from kiln.tune.study import tune as run_tune

    check_output(report, "--report")
    plan = plan_of(model, config, base)
    objectives = plan.objectives
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

        result = run_tune(plan, output, workers=config.workers, say=say, on_trial=on_trial,
                          warm_start=config.warm_start).to_json()  # fmt: skip
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
