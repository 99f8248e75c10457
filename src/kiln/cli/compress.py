"""`kiln compress`: QAT, structured pruning and distillation of a PyTorch model, each ending
in a verified artifact; one table of parameters, FLOPs, P50 and held-out accuracy."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from kiln.cli.console import JsonOpt, console, duration, emit_json, progress

ModelArg = Annotated[
    str,
    typer.Argument(
        help="module:factory returning a torch.nn.Module, e.g. "
        "kiln.compress.models:digits_cnn (trained on --data first unless --no-train)."
    ),
]
DataOpt = Annotated[
    str,
    typer.Option(
        "--data",
        help="module:loader returning a kiln.compress.data.Dataset (train/val/test), e.g. "
        "kiln.compress.data:digits (scikit-learn's bundled digits, offline).",
    ),
]
MethodOpt = Annotated[
    str,
    typer.Option(
        help="qat (int8-aware fine-tuning, shown beside post-training int8), prune "
        "(channels / heads / FFN neurons removed, then fine-tuned), distill (a smaller "
        "student taught by the model), or all (each, and prune → distill → QAT → int8)."
    ),
]
OutputOpt = Annotated[
    Path | None,
    typer.Option(
        "-o", "--output", help="Write the fastest artifact within budget (fp32 included) here."
    ),
]
MetricOpt = Annotated[
    str, typer.Option(help="What the budget is in: accuracy (top-1 on held-out data).")
]
MaxDropOpt = Annotated[
    float,
    typer.Option(help="Accuracy a method may lose against fp32, a fraction (0.01 = 1 pt)."),
]
TimeOpt = Annotated[
    str | None,
    typer.Option(
        "--time", help="Stop training and skip methods not started after this long, e.g. 15m."
    ),
]
AmountOpt = Annotated[
    float | None,
    typer.Option(help="Fraction of units to prune (default: the most of 0.75/0.5/0.25 in budget)."),
]
ImportanceOpt = Annotated[
    str, typer.Option(help="Pruning importance: taylor (first-order) or magnitude.")
]
StudentOpt = Annotated[
    str | None,
    typer.Option(
        help="module:factory of the student (default: half a built-in model; for other "
        "models --method all skips distillation)."
    ),
]
EpochsOpt = Annotated[int, typer.Option(help="Training epochs of the fp32 recipe.")]
TrainOpt = Annotated[
    bool, typer.Option("--train/--no-train", help="Train the model on --data first.")
]
KeepOpt = Annotated[
    Path | None, typer.Option(help="Keep every method's artifact in this directory.")
]
ForceOpt = Annotated[
    bool, typer.Option(help="Replace whatever is at -o, not only a Kiln artifact.")
]


def compress(
    model: ModelArg, data: DataOpt = "kiln.compress.data:digits", method: MethodOpt = "all",
    output: OutputOpt = None, metric: MetricOpt = "accuracy", max_drop: MaxDropOpt = 0.01,
    time: TimeOpt = None, amount: AmountOpt = None, importance: ImportanceOpt = "taylor",
    student: StudentOpt = None, epochs: EpochsOpt = 20, train: TrainOpt = True,
    keep: KeepOpt = None, force: ForceOpt = False, as_json: JsonOpt = False,
) -> None:  # fmt: skip
    """Compress a PyTorch model and compile each result into a verified artifact.

    Trains MODEL on --data (unless --no-train), then per --method builds an artifact, checks
    its accuracy on the held-out test split against fp32, and times every artifact
    interleaved at batch 64. The fastest one within --max-drop, the uncompressed fp32 one
    included, goes to -o. Example:

      kiln compress kiln.compress.models:digits_cnn --method all --max-drop 0.01 -o cnn.kiln
    """
    from kiln.compress import compress as run_compress
    from kiln.compress.loading import load_callable
    from kiln.compress.train import Recipe

    factory = load_callable(model, "model")
    loader = load_callable(data, "--data")
    make_student = load_callable(student, "--student") if student else None
    budget = duration(time) if time is not None else None
    with progress() as bar:
        task = bar.add_task(f"compressing {model}")
        result = run_compress(
            factory, loader, output, method=method, metric=metric, max_drop=max_drop,
            time_budget=budget, amount=amount, importance=importance, student=make_student,
            train=train, recipe=Recipe(epochs=epochs), workdir=keep, force=force,
            progress=lambda msg: bar.update(task, description=msg),
        ).to_json()  # fmt: skip
    if as_json:
        emit_json(result)
        return
    _table(result)


def _table(result: dict[str, Any]) -> None:
    from rich.table import Table

    base = result["methods"]["fp32"]
    table = Table(
        title=f"{result['model']} on {result['data']}: batch {result['batch']}, accuracy on "
        "the held-out test split"
    )
    for column in ("method", "precision", "params", "GFLOPs", "P50 ms", "speedup", "accuracy"):
        table.add_column(column, justify="left" if column == "method" else "right")
    for name, row in result["methods"].items():
        speedup = base["p50_ms"] / row["p50_ms"] if row["p50_ms"] else float("nan")
        drop = (row["accuracy"] - base["accuracy"]) * 100
        shown = f"{row['accuracy']:.1%}" + ("" if name == "fp32" else f" ({drop:+.1f} pt)")
        marker = " ←" if name == result["chosen"] else ""
        table.add_row(
            name + marker, row["precision"], f"{row['params']:,}", f"{row['flops'] / 1e9:.3f}",
            f"{row['p50_ms']:.2f}", f"{speedup:.2f}×", shown,
        )  # fmt: skip
    console.print(table)
    for name, why in result["skipped"].items():
        console.print(f"{name}: skipped, {why}", highlight=False)
    if result["note"]:
        console.print(f"note: {result['note']}", highlight=False)
    if result["output"]:
        console.print(f"wrote {result['output']} ({result['chosen']})", highlight=False)
