"""What every verb shares: the consoles, the progress bar, JSON output and common options.

A leaf: it imports nothing from Kiln but its error type, `kiln.home`'s output check and
`kiln.units`' duration reader, so any verb can use it and `kiln --help` stays fast.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from kiln.errors import KilnError
from kiln.home import output_problem
from kiln.units import parse_duration

# Off a terminal (a pipe, a log file, CI) with no COLUMNS to go by, rich takes 80 columns and
# cuts table cells short ("python-lo…"); a log or a grep needs the names whole.
PIPED_WIDTH = 160


def make_console(stderr: bool = False) -> Console:
    """A console as wide as the terminal; off one, PIPED_WIDTH unless COLUMNS says."""
    made = Console(stderr=stderr)
    if not made.is_terminal and not os.environ.get("COLUMNS"):
        made.width = PIPED_WIDTH
    return made


console = make_console()
err = make_console(stderr=True)

ModelArg = Annotated[str, typer.Argument(help="An .onnx file or zoo:NAME (see `kiln zoo list`).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]
AUTO_FLAGS = "--backend auto --precision auto"


PROGRESS_ENV = "KILN_PROGRESS"


def progress() -> Progress | LogProgress:
    """A spinner with a changing description on stderr, gone when the step ends; off a
    terminal (a batch job, `| tee`, nohup), where a bar is noise, the descriptions as plain
    lines instead (LogProgress)."""
    if not err.is_terminal:
        # KILN_PROGRESS=off: nothing at all (a caller that reads stderr as the error alone)
        return LogProgress(quiet=os.environ.get(PROGRESS_ENV, "").lower() == "off")
    # markup=False: descriptions hold user paths
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}", markup=False),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    )


class LogProgress:
    """`progress()` for logs: each new description a plain line on stderr with the time
    since the start, at most one every LOG_EVERY_S seconds (the newest wins), so a long
    compile shows it is alive without flooding the log. A description that had to wait is
    written when its turn comes, if no newer one came meanwhile: a long step is never silent."""

    LOG_EVERY_S = 5.0

    def __init__(self, quiet: bool = False) -> None:
        self._start = time.monotonic()
        self._last = self._start - self.LOG_EVERY_S  # the first description goes out at once
        self._quiet = quiet
        self._pending: str | None = None
        self._timer: threading.Timer | None = None
        self._lock = threading.Lock()

    def __enter__(self) -> LogProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._pending = None
            if self._timer is not None:
                self._timer.cancel()

    def add_task(self, description: str, **_: Any) -> int:
        self.update(0, description=description)
        return 0

    def update(self, task: int, description: str | None = None, **_: Any) -> None:
        if not description or self._quiet:
            return
        with self._lock:
            wait = self._last + self.LOG_EVERY_S - time.monotonic()
            self._pending = description
            if wait <= 0:
                self._write()
            elif self._timer is None or not self._timer.is_alive():
                self._timer = threading.Timer(wait, self._flush)
                self._timer.daemon = True
                self._timer.start()

    def _flush(self) -> None:
        with self._lock:
            if self._pending is not None:
                self._write()

    def _write(self) -> None:
        now = time.monotonic()
        self._last = now
        print(f"[{now - self._start:6.0f} s] {self._pending}", file=sys.stderr, flush=True)
        self._pending = None


class PlainProgress:
    """Progress for logs, where the live bar is off (stderr not a terminal: a batch job,
    `| tee`, nohup): called with each state, it writes `render(state)` as one plain line on
    stderr once every `seconds` — the first after `seconds`, so a short run stays quiet.
    Picklable when `render` is a module-level function, so a rank of a job can carry it."""

    def __init__(self, render: Callable[[Any], str], seconds: float) -> None:
        self.render, self.seconds = render, seconds
        self._last = time.monotonic()

    def __call__(self, state: Any) -> None:
        now = time.monotonic()
        if now - self._last >= self.seconds:
            self._last = now
            print(self.render(state), file=sys.stderr, flush=True)


def write_results(output: Path | None, result: Any) -> None:
    """`-o FILE`: the results as JSON, written whole or not at all; one line if it cannot be."""
    if output is None:
        return
    from kiln.home import atomic_write_json

    try:
        atomic_write_json(output, result)
    except OSError as exc:
        raise KilnError(
            f"-o {output}: could not write the results ({exc.strerror or exc})."
        ) from None


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


def duration(text: str, flag: str = "--time") -> float:
    """A duration flag ('15m', '90s', '1h30m', '300': seconds) in seconds, KilnError naming
    the flag."""
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise KilnError(
            f"{flag} {text}: give a positive duration, e.g. {flag} 15m ({exc})."
        ) from None


def check_output(path: Path | None, flag: str = "-o") -> None:
    """Refuse, before any work, a file path the verb could not write at the end (a missing
    or read-only directory, a directory where a file goes), naming the flag."""
    if path is None:
        return
    problem = output_problem(path)
    if problem:
        raise KilnError(f"{flag} {path}: {problem}. Nothing was done; choose another {flag} path.")


def part_path(path: Path, part: str) -> Path:
    """Where a per-part report of a partitioned artifact goes: OUTPUT-PART.SUFFIX."""
    return path.with_name(f"{path.stem}-{part}{path.suffix}")


def speed_advice(verdict: str | None, what: str, baseline: str, source: str, auto: bool) -> str:
    """What a speedup's verdict means, and the command to try when Kiln's artifact is not
    beyond noise faster than `baseline` ("" when it is, or there is no verdict)."""
    if verdict in (None, "faster", "baseline"):
        return ""
    if verdict == "unknown":
        return (
            f"whether {what} is faster than {baseline} is unknown: the spread needs 3 or more "
            "rounds (--rounds 3)."
        )
    found = (
        f"{what} is no faster than {baseline} beyond noise"
        if verdict != "slower"
        else f"{what} is slower than {baseline}"
    )
    if auto:
        if verdict == "slower":
            return f"{found}; no engine or precision Kiln tried was faster here."
        return (
            f"{found}; no engine or precision Kiln tried was faster beyond noise (on a busy "
            "machine more --rounds narrow the spread)."
        )
    return (
        f"{found}. For every engine and precision within the accuracy budget, try: "
        f"kiln optimize {shlex.quote(source)} {AUTO_FLAGS}"
    )


# Options shared by the verbs that run two sides of one model (compare, debug).
InputsOpt = Annotated[
    Path | None,
    typer.Option("--inputs", help=".npz with one array per input (default: synthesized)."),
]
ShapeOpt = Annotated[
    list[str],
    typer.Option("--shape", help="INPUT=D0xD1x... or DIM=N for synthesized inputs."),
]
