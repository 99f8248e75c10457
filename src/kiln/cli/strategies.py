"""`kiln strategies`: the strategy library — what every finished study and the feedback loop
learned on each hardware class."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from kiln.cli.console import JsonOpt, check_output, console, emit_json
from kiln.errors import KilnError

app = typer.Typer(
    help="The strategy library: winners of past studies (they warm-start similar models) and "
    "the strategies the feedback loop adopted or refused, with their evidence.",
    no_args_is_help=True,
)
StorageOpt = Annotated[
    str | None, typer.Option(help="Library database URL (default: sqlite under KILN_HOME).")
]


def _library(storage: str | None):  # noqa: ANN202
    from kiln.tune.library import Library
    from kiln.tune.storage import default_url

    return Library(storage or default_url())


@app.command("list")
def list_(
    storage: StorageOpt = None,
    every_machine: Annotated[
        bool, typer.Option("--all", help="Records of every hardware class, not only this one.")
    ] = False,
    as_json: JsonOpt = False,
) -> None:
    """Records of this machine's hardware class (--all: every class)."""
    from rich.table import Table

    from kiln.tune.signature import hardware

    machine = hardware()["class"]
    records = _library(storage).records(None if every_machine else machine)
    if as_json:
        emit_json([r.to_json() for r in records])
        return
    table = Table(title=f"strategy library ({'all hardware' if every_machine else machine})")
    for column in ("id", "kind", "model", "objective", "engine/precision", "gain", "hardware"):
        table.add_column(column, overflow="fold")
    for r in records:
        speed = (r.gains or {}).get("speedup")
        gain = f"{speed['value']:.2f}× ({speed['low']:.2f}–{speed['high']:.2f})" if speed else ""
        table.add_row(
            str(r.id), r.kind, r.model, r.objective,
            f"{r.config.get('engine')}/{r.config.get('precision')}", gain,
            f"{r.hardware.get('cpu')} {r.hardware.get('cores')} cores",
        )  # fmt: skip
    console.print(table)


@app.command()
def show(
    record_id: Annotated[int, typer.Argument(help="The record's id (see kiln strategies list).")],
    storage: StorageOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """One record in full: signature, winning config, Pareto front, evidence; a field per row
    (nested values as JSON), or the record as JSON with --json."""
    from rich.table import Table

    record = _library(storage).get(record_id).to_json()
    if as_json:
        return emit_json(record)
    table = Table(title=f"strategy {record_id}", show_header=False)
    table.add_column("field", style="bold")
    table.add_column("value", overflow="fold")
    for key, value in record.items():
        shown = value if isinstance(value, str) else json.dumps(value, indent=1, default=float)
        table.add_row(key, shown)
    console.print(table, highlight=False, markup=False)


@app.command()
def export(
    output: Annotated[
        Path, typer.Option("-o", "--output", help="JSON file to write; - for stdout.")
    ],
    storage: StorageOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Every record, as JSON (to import into another library)."""
    from kiln.home import atomic_write_json

    to_stdout = str(output) == "-"
    if not to_stdout:
        check_output(output)
    records = [r.to_json() for r in _library(storage).records()]
    if to_stdout:  # the records are the output: no summary beside them
        emit_json(records)
        return
    atomic_write_json(output, records)
    if as_json:
        emit_json({"exported": len(records), "path": str(output)})
    else:
        console.print(f"{len(records)} records → {output}", highlight=False)


@app.command("import")
def import_(
    source: Annotated[
        Path, typer.Argument(help="A JSON file written by kiln strategies export; - for stdin.")
    ],
    storage: StorageOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Add the records of an exported file (each keeps its own hardware class). Every record
    is checked before any is added; a record the library already holds is not added again."""
    import sys

    from kiln.tune.library import check_record

    try:
        text = sys.stdin.read() if str(source) == "-" else source.read_text()
    except FileNotFoundError:
        raise KilnError(f"{source}: no such file.") from None
    except (OSError, UnicodeDecodeError) as exc:
        why = getattr(exc, "strerror", None) or exc
        raise KilnError(f"{source}: cannot read it ({why}).") from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise KilnError(f"{source}: not JSON ({exc}).") from None
    if not isinstance(data, list):
        raise KilnError(f"{source}: expected the JSON list kiln strategies export writes.")
    records = [check_record(item, f"{source}: record {i}") for i, item in enumerate(data)]
    library = _library(storage)
    before = {r.id for r in library.records()}
    ids = [library.add(r) for r in records]
    added = [i for i in dict.fromkeys(ids) if i not in before]
    if as_json:
        emit_json({"imported": len(added), "already_present": len(ids) - len(added), "ids": ids})
    else:
        present = len(ids) - len(added)
        console.print(f"imported {len(added)} records"
                      + (f"; {present} already in the library" if present else ""),
                      highlight=False)  # fmt: skip


@app.command()
def forget(
    record_id: Annotated[int | None, typer.Argument(help="The record to remove.")] = None,
    model: Annotated[str | None, typer.Option(help="Remove every record of this model.")] = None,
    storage: StorageOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Remove a record, or every record of a model (one that is not there is an error, as
    for show)."""
    if record_id is None and model is None:
        raise KilnError("say what to forget: a record id, or --model NAME.")
    removed = _library(storage).forget(record_id, model)
    if as_json:
        emit_json({"removed": removed})
    else:
        console.print(f"removed {removed} record{'s' if removed != 1 else ''}", highlight=False)
