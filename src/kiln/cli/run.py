"""`kiln run`: an artifact on inputs from an .npz file, its outputs to another."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kiln.cli.console import console
from kiln.errors import KilnError


def run(
    artifact: Annotated[Path, typer.Argument(help="A NAME.kiln artifact directory.")],
    inputs: Annotated[Path, typer.Option("--inputs", help=".npz with one array per input.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write outputs (.npz).")],
) -> None:
    """Run an artifact on inputs from an .npz file and write its outputs to another."""
    import io

    import numpy as np

    from kiln.home import atomic_write_bytes
    from kiln.ir.inputs import read_inputs
    from kiln.runtime import Session

    session = Session(artifact)
    feeds = read_inputs(str(inputs), session.interface)
    outputs = session.run(None, feeds)
    if not output.absolute().parent.is_dir():
        raise KilnError(f"{output}: the directory {output.absolute().parent} does not exist.")
    data = io.BytesIO()
    np.savez(data, **dict(zip(session.output_names, outputs, strict=True)))
    try:
        atomic_write_bytes(output, data.getvalue())
    except OSError as exc:
        raise KilnError(f"{output}: could not write the outputs ({exc.strerror or exc}).") from None
    console.print(f"wrote {len(outputs)} outputs to {output}")
