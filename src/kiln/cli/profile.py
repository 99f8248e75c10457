"""`kiln profile`: where the time and memory go, against this machine's measured limits."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kiln.cli.console import (
    JsonOpt,
    at_least,
    check_output,
    console,
    emit_json,
    part_path,
    progress,
)
from kiln.cli.pipeline import DataOpt, PipelineStreamsOpt, profile_pipeline_verb
from kiln.errors import KilnError

ModelArg = Annotated[
    str,
    typer.Argument(
        help="An .onnx file, zoo:NAME, a saved torch.export program (.pt2), or a NAME.kiln "
        "artifact directory."
    ),
]
BackendOpt = Annotated[
    str | None,
    typer.Option(help="Engine: ort or openvino (default: the artifact's own, else ort)."),
]
BatchOpt = Annotated[int, typer.Option(help="Batch size of the synthesized inputs.")]
ShapeOpt = Annotated[
    list[str],
    typer.Option("--shape", help="INPUT=D0xD1x... for a synthesized input (repeatable)."),
]
RunsOpt = Annotated[int, typer.Option(help="Profiled runs, and as many timed runs.")]
RoundsOpt = Annotated[
    int, typer.Option(help="Rounds alternating timing and profiling (noise control).")
]
OutputOpt = Annotated[
    Path | None, typer.Option("-o", "--output", help="Write a self-contained HTML report.")
]
TraceOpt = Annotated[
    Path | None, typer.Option("--trace", help="Write a Chrome/Perfetto trace (JSON).")
]


def profile(
    model: ModelArg, backend: BackendOpt = None, batch: BatchOpt = 1, shape: ShapeOpt = [],  # noqa: B006
    runs: RunsOpt = 20, rounds: RoundsOpt = 5, output: OutputOpt = None, trace: TraceOpt = None,
    data: DataOpt = None, streams: PipelineStreamsOpt = None, as_json: JsonOpt = False,
) -> None:  # fmt: skip
    """Where the time goes, op by op, against this machine's measured peaks.

    Latency (P50/P90/P99, jitter), per-kernel times mapped to the original nodes, a roofline
    against measured peaks, and the bottlenecks with a Kiln action for each. A pipeline
    artifact: each query on --data split into glue, queueing and compute per stage."""
    from kiln.artifact.parts import is_partitioned
    from kiln.ir.inputs import parse_shapes
    from kiln.profile import profile_model
    from kiln.report import print_profile, write_html, write_trace

    at_least(batch=(batch, 1), runs=(runs, 1), rounds=(rounds, 1))
    check_output(output, "-o")
    check_output(trace, "--trace")
    if Path(model, "pipeline.json").is_file() or data is not None or streams is not None:
        return profile_pipeline_verb(model, data, streams, trace, output, as_json)
    if is_partitioned(model):
        if backend is not None or shape:
            raise KilnError(
                f"{model} is a partitioned artifact: each part runs on its own engine and "
                "receives what the parts before it computed; drop --backend and --shape."
            )
        _profile_parts(model, batch, runs, rounds, output, trace, as_json)
        return
    with progress() as bar:
        task = bar.add_task(f"loading {model}")
        say = lambda msg: bar.update(task, description=msg)  # noqa: E731
        result = profile_model(
            model,
            backend=backend,
            batch=batch,
            shapes=parse_shapes(shape),
            runs=runs,
            rounds=rounds,
            say=say,
        )
        try:
            if output is not None:
                say(f"writing {output}")
                write_html(result, output)
            if trace is not None:
                say(f"writing {trace}")
                write_trace(result, trace)
        except OSError as exc:
            raise KilnError(f"could not write the report ({exc.strerror or exc}).") from None
    if as_json:
        # The raw per-run records go to --trace; everything derived from them is here.
        emit_json(_no_records(result))
        return
    print_profile(result, console)
    for path, what in ((output, "report"), (trace, "trace")):
        if path is not None:
            console.print(f"wrote {what} {path}")


def _no_records(result: dict) -> dict:
    return {k: v for k, v in result.items() if k != "records"}


def _profile_parts(
    model: str, batch: int, runs: int, rounds: int, output: Path | None, trace: Path | None,
    as_json: bool,
) -> None:  # fmt: skip
    """Every part of a partitioned artifact profiled on what it receives; a report and a trace
    per part (OUTPUT-PART.html), and the whole's end-to-end latency."""
    from kiln.profile.parts import profile_parts
    from kiln.report import print_profile, write_html, write_trace

    written = []
    with progress() as bar:
        task = bar.add_task(f"loading {model}")
        say = lambda msg: bar.update(task, description=msg)  # noqa: E731
        result = profile_parts(model, batch=batch, runs=runs, rounds=rounds, say=say)
        try:
            for name, part in result["parts"].items():
                for path, write in ((output, write_html), (trace, write_trace)):
                    if path is not None:
                        each = part_path(path, name)
                        write(part, each)
                        written.append(each)
        except OSError as exc:
            raise KilnError(f"could not write the report ({exc.strerror or exc}).") from None
    if as_json:
        parts = result["parts"]
        emit_json({**result, "parts": {n: _no_records(p) for n, p in parts.items()}})
        return
    for name, part in result["parts"].items():
        console.rule(f"part {name}: {result['placement'][name]}")
        print_profile(part, console)
    whole = result["end_to_end"]
    console.print(
        f"the whole, parts at once as kiln.Session runs them: P50 {whole['p50_ms']:.2f} ms, "
        f"P99 {whole['p99_ms']:.2f} ms over {whole['runs']} runs"
    )
    for path in written:
        console.print(f"wrote {path}")
