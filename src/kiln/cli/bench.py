"""`kiln bench`: Kiln against the engines a user would otherwise pick, interleaved."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from kiln.bench.config import BenchConfig
from kiln.cli.console import (
    JsonOpt,
    check_output,
    console,
    emit_json,
    progress,
    speed_advice,
    write_results,
)
from kiln.cli.flags import Flag, command, options
from kiln.cli.pipeline import DataOpt, PeerOpt, StreamCountsOpt, bench_pipeline_verb

ModelArg = Annotated[
    str,
    typer.Argument(
        help="An .onnx file, zoo:NAME, a saved torch.export program (.pt2), or a NAME.kiln "
        "artifact."
    ),
]
OutputOpt = Annotated[
    Path | None, typer.Option("-o", "--output", help="Also write the results as JSON here.")
]


def _shapes(given: list[str]) -> dict[str, tuple[int, ...]]:
    from kiln.ir.inputs import parse_shapes

    return parse_shapes(given)


BENCH_FLAGS = options(BenchConfig, flags={
    "shapes": Flag(names=("--shape",), type=list[str], default=[], parse=_shapes),
    "memory": Flag(names=("--memory/--no-memory",)),
})  # fmt: skip


@command
def bench(
    model: ModelArg, config: Any = BENCH_FLAGS, output: OutputOpt = None, as_json: JsonOpt = False,
    data: DataOpt = None, streams: StreamCountsOpt = "1,4,16", against_pipeline: PeerOpt = None,
) -> None:  # fmt: skip
    """Kiln against other engines, interleaved in one process: P50/P90/P99, jitter, throughput.

    Each engine's P50 is the median of its per-round P50s; its speedup is the first --against
    engine's P50 over its own, shown with the range of per-round ratios and a verdict: faster,
    no different within noise, or slower (3 rounds or more; fewer leave the spread unknown).
    Every jitter stands beside the host's jitter floor, measured in the same run (fixed-work
    probes between the rounds), and each engine's CQI is its fraction of the measured peak
    × (1 − jitter). Steadiness: each engine's jitter over the steadiest other engine's, with
    its bootstrap interval — steadiest, tied (no different within noise) or less steady.
    A pipeline artifact is measured on --data at each of --streams, --rounds passes of each way
    taking turns (see --data).
    """
    from kiln.bench.config import run
    from kiln.report.terminal import print_bench

    check_output(output)  # before the benchmark, not after it: its results are not lost
    if Path(model, "pipeline.json").is_file():
        return bench_pipeline_verb(model, data, streams, against_pipeline, output, as_json,
                                   config.rounds)  # fmt: skip
    with progress() as bar:
        task = bar.add_task("preparing")
        say = lambda msg: bar.update(task, description=msg)  # noqa: E731
        result = run(model, config, say, " ".join(sys.argv))
    result["advice"] = _advice(result)
    write_results(output, result)
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
