"""`kiln bench`: Kiln against the engines a user would otherwise pick, interleaved."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from kiln.cli.console import (
    JsonOpt,
    at_least,
    check_output,
    console,
    emit_json,
    progress,
    speed_advice,
)
from kiln.errors import KilnError


def bench(
    model: Annotated[
        str,
        typer.Argument(
            help="An .onnx file, zoo:NAME, a saved torch.export program (.pt2), or a NAME.kiln "
            "artifact."
        ),
    ],
    against: Annotated[
        str,
        typer.Option(
            help="Comma-separated engines: ort, ort-basic, ort-transformers, ort-int8, openvino, "
            "openvino-bf16, openvino-int8 (the int8 ones: each tool's defaults, calibrated on "
            "--calib or on synthetic samples)."
        ),
    ] = "ort,ort-basic",
    batch: Annotated[int, typer.Option(help="Batch size of the synthesized inputs.")] = 1,
    inputs: Annotated[
        str | None,
        typer.Option(help="Time and measure drift on these inputs (.npz) instead of synthetic."),
    ] = None,
    calib: Annotated[
        str | None,
        typer.Option(help="Calibration samples (.npz or directory) for the int8 engines."),
    ] = None,
    shape: Annotated[
        list[str], typer.Option("--shape", help="INPUT=D0xD1x... for a synthesized input.")
    ] = [],  # noqa: B006
    rounds: Annotated[int, typer.Option(help="Interleaved rounds.")] = 5,
    memory: Annotated[
        bool,
        typer.Option(
            "--memory/--no-memory",
            help="Also measure each engine's peak resident memory (load and run), each in a "
            "process of its own, after the timing.",
        ),
    ] = True,
    runs: Annotated[
        int,
        typer.Option(
            help="Runs per engine per round (rounds × runs ≥ 662 back a P99 at 99 % confidence)."
        ),
    ] = 20,
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="Also write the results as JSON here.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Kiln against other engines, interleaved in one process: P50/P90/P99, jitter, throughput.

    Each engine's P50 is the median of its per-round P50s; its speedup is the first --against
    engine's P50 over its own, shown with the range of per-round ratios and a verdict: faster,
    no different within noise, or slower (3 rounds or more; fewer leave the spread unknown).
    Every jitter stands beside the host's jitter floor, measured in the same run (fixed-work
    probes between the rounds), and each engine's CQI is its fraction of the measured peak
    × (1 − jitter). Steadiness: each engine's jitter over the steadiest other engine's, with
    its bootstrap interval — steadiest, tied (no different within noise) or less steady.
    """
    from kiln.bench.report import run_bench
    from kiln.ir.inputs import parse_shapes
    from kiln.report.terminal import print_bench

    at_least(batch=(batch, 1), runs=(runs, 1), rounds=(rounds, 1))
    check_output(output)  # before the benchmark, not after it: its results are not lost
    with progress() as bar:
        task = bar.add_task("preparing")
        say = lambda msg: bar.update(task, description=msg)  # noqa: E731
        result = run_bench(
            model, against, batch, rounds, runs, say, " ".join(sys.argv), parse_shapes(shape),
            inputs=inputs, calib=calib, memory=memory,
        )  # fmt: skip
    result["advice"] = _advice(result)
    if output:
        from kiln.home import atomic_write_json

        try:
            atomic_write_json(output, result)
        except OSError as exc:
            raise KilnError(
                f"-o {output}: could not write the results ({exc.strerror or exc})."
            ) from None
    if as_json:
        emit_json(result)
    else:
        print_bench(result, console)


def _advice(result: dict) -> str:
    """What Kiln's row means against the baseline, and what to try when it is not faster."""
    kiln, built = result["engines"].get("kiln"), result.get("kiln_build") or {}
    if kiln is None or result["baseline"] == "kiln":
        return ""
    return speed_advice(
        kiln["verdict"], "kiln", result["baseline"], built.get("source", result["model"]),
        auto=built.get("auto", False),
    )  # fmt: skip
