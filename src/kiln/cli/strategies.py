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
    """One record in full: signature, winning config, Pareto front, evidence (JSON either
    way: a record is nested data)."""
    emit_json(_library(storage).get(record_id).to_json())


@app.command()
def export(
    output: Annotated[Path, typer.Option("-o", "--output", help="JSON file to write.")],
    storage: StorageOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Every record, as JSON (to import into another library)."""
    from kiln.home import atomic_write_json

    check_output(output)
    records = [r.to_json() for r in _library(storage).records()]
    atomic_write_json(output, records)
    if as_json:
        emit_json({"exported": len(records), "path": str(output)})
    else:
        console.print(f"{len(records)} records → {output}", highlight=False)


@app.command("import")
def import_(
    source: Annotated[Path, typer.Argument(help="A JSON file written by kiln strategies export.")],
    storage: StorageOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Add the records of an exported file (each keeps its own hardware class)."""
    from kiln.tune.library import Record

    try:
        data = json.loads(source.read_text())
        records = [
            Record(**{k: v for k, v in item.items() if k not in ("id", "created")}) for item in data
        ]
    except FileNotFoundError:
        raise KilnError(f"{source}: no such file.") from None
    except (OSError, ValueError, TypeError, AttributeError, KeyError) as exc:
        raise KilnError(f"{source}: not a strategies export ({exc}).") from None
    library = _library(storage)
    ids = [library.add(r) for r in records]
    if as_json:
        emit_json({"imported": len(ids), "ids": ids})
    else:
        console.print(f"imported {len(ids)} records", highlight=False)


@app.command()
def forget(
    record_id: Annotated[int | None, typer.Argument(help="The record to remove.")] = None,
    model: Annotated[str | None, typer.Option(help="Remove every record of this model.")] = None,
    storage: StorageOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Remove a record, or every record of a model."""
    if record_id is None and model is None:
        raise KilnError("say what to forget: a record id, or --model NAME.")
    removed = _library(storage).forget(record_id, model)
    if as_json:
        emit_json({"removed": removed})
    else:
        console.print(f"removed {removed} record{'s' if removed != 1 else ''}", highlight=False)
