"""A pipeline artifact over a data set, each input's result written as one JSON line."""

from __future__ import annotations

import os
from pathlib import Path

from kiln.errors import KilnError
from kiln.home import atomic_write_text
from kiln.pipeline.data import load_data
from kiln.pipeline.runtime import Pipeline
from kiln.pipeline.served import to_json


def run_over(artifact: str | os.PathLike, data: str, output: str | os.PathLike,
             streams: int = 1) -> int:  # fmt: skip
    """Run the pipeline artifact over `data` on `streams` streams; write `output` (JSON
    lines, in input order, written whole or not at all); the number of results."""
    if streams < 1:
        raise KilnError(f"--streams {streams}: give 1 or more.")
    inputs = load_data(data)
    with Pipeline(artifact) as pipe:
        results = pipe.map(inputs, streams=streams)
    lines = [to_json(result).decode() for result in results]
    try:
        atomic_write_text(Path(output), "".join(line + "\n" for line in lines))
    except OSError as exc:
        raise KilnError(f"{output}: could not write the results ({exc.strerror or exc}).") from None
    return len(lines)
