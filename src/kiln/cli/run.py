"""`kiln run`: an artifact on inputs from an .npz file, its outputs to another."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kiln.cli.console import JsonOpt, check_output, console, emit_json
from kiln.errors import KilnError


def run(
    artifact: Annotated[Path, typer.Argument(help="A NAME.kiln artifact directory.")],
    inputs: Annotated[Path, typer.Option("--inputs", help=".npz with one array per input.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write outputs (.npz).")],
    as_json: JsonOpt = False,
) -> None:
    """Run an artifact on inputs from an .npz file and write its outputs to another."""
    import io

    import numpy as np

    from kiln.home import atomic_write_bytes
    from kiln.ir.inputs import read_inputs
    from kiln.runtime import Session

    check_output(output)  # before loading and running: a bad -o costs nothing
    session = Session(artifact)
    feeds = read_inputs(str(inputs), session.interface)
    outputs = session.run(None, feeds)
    named = dict(zip(session.output_names, outputs, strict=True))
    data = io.BytesIO()
    np.savez(data, **named)
    try:
        atomic_write_bytes(output, data.getvalue())
    except OSError as exc:
        raise KilnError(f"{output}: could not write the outputs ({exc.strerror or exc}).") from None
    if as_json:
        emit_json(
            {
                "artifact": str(artifact),
                "inputs": str(inputs),
                "output": str(output),
                "outputs": [
                    {
                        "name": name,
                        "dtype": str(getattr(value, "dtype", "sequence")),
                        "shape": list(getattr(value, "shape", [len(value)])),
                    }
                    for name, value in named.items()
                ],
            }
        )
    else:
        console.print(f"wrote {len(outputs)} outputs to {output}", highlight=False, markup=False)
