"""The `kiln` command line: one module per verb. Every error the user can cause is one line
on stderr and exit code 2.

Each verb keeps its heavy imports inside the command, so `kiln --help` stays fast.
"""

from __future__ import annotations

import inspect
import os
import signal
import sys
from typing import Annotated

import typer

from kiln.cli import (
    bench,
    compare,
    compress,
    debug,
    doctor,
    export,
    optimize,
    profile,
    run,
    serve,
    split,
    strategies,
    train,
    tune,
    zoo,
)
from kiln.cli.console import err
from kiln.cli.stopped import Stopped
from kiln.errors import KilnError

app = typer.Typer(
    help="Kiln: compile, verify and benchmark neural-network models for this machine.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},  # every verb inherits -h
)


def _version(value: bool) -> None:
    if value:
        from kiln import __version__

        typer.echo(f"kiln {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print Kiln's version and exit."
        ),
    ] = False,
) -> None:
    """Kiln: compile, verify and benchmark neural-network models for this machine."""


app.add_typer(zoo.app, name="zoo")
app.command()(optimize.optimize)
app.command()(run.run)
app.command()(bench.bench)
app.command()(doctor.doctor)
app.command()(serve.serve)
app.command()(profile.profile)
app.command()(tune.tune)
app.command()(compare.compare)
app.command()(compress.compress)
app.command()(debug.debug)
app.command()(train.train)
app.command()(export.export)
app.command()(split.split)
app.add_typer(strategies.app, name="strategies")


def _reflowed(doc: str) -> str:
    """A verb's docstring with each prose paragraph on one line: rich keeps a help text's own
    line breaks and wraps each line again, so 95-column docstrings read as ragged halves at
    80 columns. Paragraphs with a command example keep their lines."""
    paragraphs = inspect.cleandoc(doc).split("\n\n")
    return "\n\n".join(p if _is_example(p) else " ".join(p.splitlines()) for p in paragraphs)


def _is_example(paragraph: str) -> bool:
    lines = paragraph.splitlines()
    return any(line.startswith((" ", "kiln ", "$ ")) or line.endswith("\\") for line in lines)


for _info in (*app.registered_commands, *strategies.app.registered_commands):
    if _info.help is None and _info.callback is not None and _info.callback.__doc__:
        _info.help = _reflowed(_info.callback.__doc__)


_MAIN_PID = os.getpid()


def _stop(signum: int, _frame: object) -> None:
    if os.getpid() != _MAIN_PID:
        # A process a library forked (OpenVINO's telemetry sender) inherits this handler: it
        # ends quietly, as the signal's default would end it, instead of printing a traceback.
        os._exit(128 + signum)
    raise Stopped(signum)


def main() -> None:
    from rich.text import Text

    global _MAIN_PID
    _MAIN_PID = os.getpid()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, _stop)  # kiln.serve.serving.run installs its own: a graceful drain
    try:
        app()
    except KilnError as exc:
        # A Text, not markup: paths and messages may hold '[...]' or ':name:'. soft_wrap keeps
        # the message on one line whatever the terminal's width.
        line = Text.assemble(("error:", "bold red"), " ", " ".join(str(exc).splitlines()))
        err.print(line, highlight=False, soft_wrap=True)
        sys.exit(2)
    except (Stopped, KeyboardInterrupt) as exc:
        signum = exc.signum if isinstance(exc, Stopped) else signal.SIGINT
        what = "interrupted" if signum == signal.SIGINT else "terminated"
        said = exc.said if isinstance(exc, Stopped) else "nothing was written."
        err.print(f"{what}; {said}", highlight=False, soft_wrap=True)
        sys.exit(128 + signum)
    except Exception as exc:  # a bug in Kiln: the backstop, never the fix
        where = _crash_report(exc)
        first = (str(exc).strip().splitlines() or [""])[0]
        err.print(
            f"internal error: {type(exc).__name__}: {first} — a bug in Kiln, not your input; "
            f"the traceback is in {where}",
            highlight=False, markup=False, soft_wrap=True,
        )  # fmt: skip
        sys.exit(INTERNAL_ERROR)


INTERNAL_ERROR = 70  # EX_SOFTWARE


def _crash_report(exc: BaseException) -> str:
    """The traceback, written under KILN_HOME/crashes for a bug report (the terminal gets one
    line); where it went, or why it could not be written."""
    import datetime as dt
    import traceback

    from kiln.home import atomic_write_text, kiln_home

    text = "".join(traceback.format_exception(exc))
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%S%f")
    path = kiln_home() / "crashes" / f"crash-{stamp}.txt"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, f"kiln {' '.join(sys.argv[1:])}\n{text}")
    except OSError as why:
        return f"(nowhere: {why})"
    return str(path)
