"""`kiln compare A B`: two versions of a model layer by layer, and the layer that broke."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from kiln.cli.console import (
    InputsOpt,
    JsonOpt,
    ShapeOpt,
    check_output,
    console,
    emit_json,
    err,
    part_path,
    progress,
)
from kiln.cli.pipeline import DataOpt, compare_pipeline_verb
from kiln.errors import KilnError

if TYPE_CHECKING:
    from kiln.debug import Comparison

SIDE_HELP = (
    "An .onnx file, zoo:NAME, a NAME.kiln artifact, or MODEL@ENGINE:PRECISION "
    "(e.g. model.onnx@openvino:fp32, zoo:bert-tiny@ort:int8)."
)


ReferenceArg = Annotated[str, typer.Argument(help=f"The reference. {SIDE_HELP}")]
ComparedArg = Annotated[
    str | None,
    typer.Argument(help=f"What is compared with it. {SIDE_HELP} Left out for a pipeline artifact."),
]
MetricOpt = Annotated[
    str,
    typer.Option(
        help="auto: Kiln's fp32 tolerance when both sides are fp32, else cosine; "
        "or max-abs, cosine."
    ),
]
MaxDropOpt = Annotated[
    float | None,
    typer.Option("--max-drop", help="Cosine budget: a layer diverges below 1 − this (0.01)."),
]
OutputOpt = Annotated[
    Path | None, typer.Option("-o", "--output", help="Write a self-contained HTML report.")
]
ModelExplorerOpt = Annotated[
    Path | None,
    typer.Option(
        "--model-explorer",
        help="Directory for Model Explorer node data (error.json, latency.json).",
    ),
]


def compare(
    a: ReferenceArg, b: ComparedArg = None, inputs: InputsOpt = None, shape: ShapeOpt = [],  # noqa: B006
    metric: MetricOpt = "auto", max_drop: MaxDropOpt = None, output: OutputOpt = None,
    model_explorer: ModelExplorerOpt = None, data: DataOpt = None, as_json: JsonOpt = False,
) -> None:  # fmt: skip
    """Run A and B on the same inputs and compare every tensor they share, layer by layer.

    Rows follow the original graph; the first divergence is the earliest layer beyond the
    budget whose inputs still agree, or, when B runs that layer at A's precision, the
    lower-precision layer before it whose error it carries. Fused kernels stay fused: only
    tensors both sides compute are compared. A pipeline artifact with --data: which stage's
    choice changed its results."""
    from kiln.artifact.parts import is_partitioned
    from kiln.debug import compare as compare_models
    from kiln.ir.inputs import parse_shapes

    if b is None or data is not None or Path(a, "pipeline.json").is_file():
        return compare_pipeline_verb(a, b, data, metric, as_json)
    check_output(output, "-o")
    _check_directory(model_explorer)
    if is_partitioned(a):
        raise KilnError(f"{a} is a partitioned artifact: give it as B, after the model it was "
                        f"built from (kiln compare MODEL {a}).")  # fmt: skip
    if is_partitioned(b):
        if model_explorer is not None:
            raise KilnError(
                f"{b} is a partitioned artifact: --model-explorer overlays one graph; give "
                f"one part ({b}/parts/PART.kiln against {b}/parts/PART.onnx)."
            )
        _compare_parts(a, b, str(inputs) if inputs is not None else None, parse_shapes(shape),
                       metric, max_drop, output, as_json)  # fmt: skip
        return
    with progress() as bar:
        task = bar.add_task(f"loading {a}")
        say = lambda msg: bar.update(task, description=msg)  # noqa: E731
        comparison = compare_models(
            a, b, inputs=str(inputs) if inputs is not None else None, shapes=parse_shapes(shape),
            metric=metric, max_drop=max_drop, say=say,
        )  # fmt: skip
        result = comparison.to_json()
        written = _write(comparison, result, output, model_explorer, say)
    if as_json:
        emit_json(result)
        return
    from kiln.report.compare import print_compare

    print_compare(result, console)
    for path in written:
        console.print(f"wrote {path}", highlight=False, markup=False)
    if model_explorer is not None:
        err.print(
            "Model Explorer: model-explorer ORIGINAL.onnx --node_data_paths="
            + ",".join(str(p) for p in written if p.suffix == ".json"),
            highlight=False,
            markup=False,
        )


def _check_directory(directory: Path | None) -> None:
    """--model-explorer: a directory to create or one to write in, checked before any work."""
    if directory is None:
        return
    if directory.exists() and not directory.is_dir():
        raise KilnError(f"--model-explorer {directory}: is a file; give a directory.")
    check_output(directory / "error.json" if directory.is_dir() else directory, "--model-explorer")


def _write(
    comparison: Comparison,
    result: dict[str, Any],
    output: Path | None,
    model_explorer: Path | None,
    say: Callable[[str], None],
) -> list[Path]:
    from kiln.debug.model_explorer import write_model_explorer
    from kiln.report.compare import write_compare_html

    written = []
    try:
        if output is not None:
            say(f"writing {output}")
            written.append(write_compare_html(result, output))
        if model_explorer is not None:
            say("profiling B for the latency overlay")
            written += write_model_explorer(comparison, model_explorer)
    except OSError as exc:
        raise KilnError(f"could not write the report ({exc.strerror or exc}).") from None
    return written


def _compare_parts(
    a: str, b: str, inputs: str | None, shapes: dict, metric: str, max_drop: float | None,
    output: Path | None, as_json: bool,
) -> None:  # fmt: skip
    """Each part of the partitioned artifact B against its original piece, on the original's
    tensors; a report per part (OUTPUT-PART.html)."""
    from kiln.debug.parts import compare_parts, parts_json
    from kiln.report.compare import print_compare, write_compare_html

    written = []
    with progress() as bar:
        task = bar.add_task(f"loading {b}")
        say = lambda msg: bar.update(task, description=msg)  # noqa: E731
        comparisons = compare_parts(a, b, inputs=inputs, shapes=shapes, metric=metric,
                                    max_drop=max_drop, say=say)  # fmt: skip
        result = parts_json(a, b, comparisons)
        try:
            for name, part in result["parts"].items():
                if output is not None:
                    written.append(write_compare_html(part, part_path(output, name)))
        except OSError as exc:
            raise KilnError(f"could not write the report ({exc.strerror or exc}).") from None
    if as_json:
        emit_json(result)
        return
    for name, part in result["parts"].items():
        console.rule(f"part {name}")
        print_compare(part, console)
    first = result["first_divergence"]
    console.print(
        f"first divergence: part {first['part']}, {first['node']}" if first
        else "every part within the budget of its original piece",
        highlight=False, markup=False,
    )  # fmt: skip
    for path in written:
        console.print(f"wrote {path}", highlight=False, markup=False)
