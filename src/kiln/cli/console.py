"""What every verb shares: the consoles, the progress bar, JSON output and common options.

A leaf: it imports nothing from Kiln but its error type, so any verb can use it and
`kiln --help` stays fast.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from kiln.errors import KilnError

console = Console()
err = Console(stderr=True)

ModelArg = Annotated[str, typer.Argument(help="An .onnx file or zoo:NAME (see `kiln zoo list`).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]


def progress() -> Progress:
    """A spinner with a changing description on stderr, gone when the step ends."""
    # markup=False: descriptions hold user paths; disabled off a terminal, where a bar is
    # noise (and rich would leave a blank line on stderr).
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}", markup=False),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    )


def emit_json(data: Any) -> None:
    """`--json`: the data on stdout, numpy scalars written as floats."""
    sys.stdout.write(json.dumps(data, indent=2, default=float) + "\n")


def at_least(**counts: tuple[int, int]) -> None:
    """Refuse a count below its minimum before any work starts, naming the flag:
    `at_least(runs=(runs, 1))` → "--runs 0: use at least 1."."""
    for name, (value, minimum) in counts.items():
        if value < minimum:
            flag = "--" + name.replace("_", "-")
            raise KilnError(f"{flag} {value}: use at least {minimum}.")
