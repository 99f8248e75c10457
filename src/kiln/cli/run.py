"""`kiln run`: an artifact on inputs from an .npz file, its outputs to another."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from kiln.cli.console import JsonOpt, check_output, console, emit_json
from kiln.errors import KilnError


def run(
    artifact: Annotated[Path, typer.Argument(help="A NAME.kiln artifact directory.")],
    inputs: Annotated[
        Path | None, typer.Option("--inputs", help=".npz with one array per input.")
    ] = None,
    output: Annotated[
        Path | None,
        typer.Option("-o", "--output", help="Where to write outputs (.npz; a pipeline's: .jsonl)."),
    ] = None,
    data: Annotated[
        str | None,
        typer.Option("--data", help="A pipeline artifact's inputs: DIR or MODULE:FUNCTION."),
    ] = None,
    streams: Annotated[int, typer.Option(help="A pipeline's streams at once.")] = 1,
    as_json: JsonOpt = False,
) -> None:
    """Run an artifact on inputs from an .npz file and write its outputs to another; or a
    pipeline artifact over --data, each input's result as one JSON line."""
    from kiln.ir.inputs import read_inputs
    from kiln.pipeline.pipeline_artifact import is_pipeline
    from kiln.runtime import Session

    if output is None:
        raise KilnError("kiln run needs -o: where to write the outputs.")
    check_output(output)  # before loading and running: a bad -o costs nothing
    if not Path(artifact).exists():
        raise KilnError(f"{artifact}: no such file or directory.")
    if is_pipeline(artifact):
        return _run_pipeline(artifact, data, output, streams, as_json)
    if inputs is None:
        raise KilnError("kiln run needs --inputs: an .npz with one array per input.")
    session = Session(artifact)
    feeds = read_inputs(str(inputs), session.interface)
    outputs = session.run(None, feeds)
    named = dict(zip(session.output_names, outputs, strict=True))
    _write_npz(output, named)
    if as_json:
        shown = [{"name": name, "dtype": str(getattr(value, "dtype", "sequence")),
                  "shape": list(getattr(value, "shape", [len(value)]))}
                 for name, value in named.items()]  # fmt: skip
        emit_json({"artifact": str(artifact), "inputs": str(inputs), "output": str(output),
                   "outputs": shown})  # fmt: skip
    else:
        said = f"{len(outputs)} output{'s' if len(outputs) != 1 else ''}"
        console.print(f"wrote {said} to {output}", highlight=False, markup=False)


def _write_npz(output: Path, named: dict) -> None:
    import io

    import numpy as np

    from kiln.home import atomic_write_bytes

    data = io.BytesIO()
    np.savez(data, **named)
    try:
        atomic_write_bytes(output, data.getvalue())
    except OSError as exc:
        raise KilnError(f"{output}: could not write the outputs ({exc.strerror or exc}).") from None


def _run_pipeline(artifact: Path, data: str | None, output: Path, streams: int,
                  as_json: bool) -> None:  # fmt: skip
    from kiln.pipeline.running import run_over

    if data is None:
        raise KilnError(
            f"{artifact} is a pipeline: give its inputs with --data DIR|MODULE:FUNCTION."
        )
    if output.suffix != ".jsonl":  # an .npz would hold JSON lines under a name that lies
        raise KilnError(f"-o {output}: a pipeline's results are JSON lines, one an input; "
                        "give a path ending in .jsonl.")  # fmt: skip
    count = run_over(artifact, data, output, streams)
    if as_json:
        emit_json({"artifact": str(artifact), "data": data, "output": str(output),
                   "results": count, "streams": streams})  # fmt: skip
    else:
        said = f"{count} result{'s' if count != 1 else ''}"
        console.print(f"wrote {said} to {output}", highlight=False, markup=False)
