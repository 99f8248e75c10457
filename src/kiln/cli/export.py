"""`kiln export`: an artifact written for a serving engine users run at scale (Triton)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Annotated

import typer

from kiln.cli.console import JsonOpt, console, emit_json, err
from kiln.errors import KilnError


def export(
    artifact: Annotated[Path, typer.Argument(help="A NAME.kiln artifact directory.")],
    triton: Annotated[
        Path | None,
        typer.Option(
            "--triton",
            help="A Triton model repository to write the model into (created if missing).",
        ),
    ] = None,
    name: Annotated[
        str | None, typer.Option(help="Model name in the repository (default: the artifact's).")
    ] = None,
    version: Annotated[int, typer.Option("--version", help="Model version directory.")] = 1,
    runtime: Annotated[
        str,
        typer.Option(
            help="native: Triton's ONNX Runtime or OpenVINO backend with Kiln's engine "
            "settings; kiln: Kiln's runtime (buckets, verified swaps) in Triton's "
            "Python backend."
        ),
    ] = "native",
    force: Annotated[
        bool, typer.Option(help="Replace an existing version directory of the model.")
    ] = False,
    json_: JsonOpt = False,
) -> None:
    """Write ARTIFACT into a Triton model repository: REPO/NAME/config.pbtxt and
    REPO/NAME/VERSION/, ready for `tritonserver --model-repository REPO`."""
    from kiln.deploy import export_triton

    if triton is None:
        raise KilnError("kiln export needs a destination: --triton REPO (a model repository).")
    done = export_triton(artifact, triton, name=name, version=version, runtime=runtime,
                         force=force)  # fmt: skip
    if json_:
        emit_json(done.to_json())
        return
    config = done.config
    batching = (f"batches of up to {config['max_batch_size']}" if config["max_batch_size"]
                else "no batching (the model has no batch dim)")  # fmt: skip
    console.print(
        f"wrote {done.version_path} and {done.path / 'config.pbtxt'}: model '{done.name}' on "
        f"Triton's {done.backend} backend, {batching}",
        highlight=False, markup=False, soft_wrap=True,
    )  # fmt: skip
    for note in done.notes:
        err.print(f"note: {note}", highlight=False, markup=False, soft_wrap=True)
    if done.runtime == "kiln":
        err.print(
            "note: Triton runs model.py with the python3 first on its PATH (or the config's "
            "EXECUTION_ENV_PATH): install kiln-ml there, with numpy<2 where Triton's Python "
            "backend stub is built against numpy 1.x",
            highlight=False, markup=False, soft_wrap=True,
        )  # fmt: skip
    console.print(
        f"serve it: tritonserver --model-repository {shlex.quote(str(done.repository))}",
        highlight=False, markup=False, soft_wrap=True,
    )  # fmt: skip
