"""`kiln.Pipeline`: a pipeline function and its models, ready to run one input or many streams."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from kiln.errors import KilnError
from kiln.pipeline.fold import fold_sessions
from kiln.pipeline.function import PipelineFunction, check_models, load_function
from kiln.pipeline.pipeline_artifact import is_pipeline, read_pipeline
from kiln.pipeline.recording import call_function
from kiln.pipeline.streams import StreamsRun, run_streams


class Pipeline:
    """A pipeline artifact (`kiln.compile_pipeline`'s output), or the user's function (a
    callable, or `module:function`) over its models: each a path (ONNX or a Kiln artifact,
    opened as `kiln.Session`) or a session already open. Calling it
    runs one input as the plain function would; `map` runs many on `streams` threads with each
    model's calls from all of them pooled into batches (streams.py).
    `max_delay_ms`: how long a stage waits for other streams' calls to join the first (0, the
    default: none — the calls that queue while a batch runs form the next one)."""

    def __init__(
        self,
        function: PipelineFunction | str | os.PathLike,
        models: Mapping[str, str | os.PathLike | Any] | None = None,
        *,
        max_delay_ms: float = 0.0,
    ) -> None:
        spec = function if isinstance(function, str) else ""
        self.manifest: dict[str, Any] | None = None
        if isinstance(function, str | os.PathLike) and is_pipeline(function):
            if models:
                raise KilnError(f"{function} is a pipeline artifact: it brings its own models.")
            self.function, models, self.manifest = read_pipeline(function)
        elif isinstance(function, os.PathLike) or (
            isinstance(function, str) and ":" not in function
        ):
            raise KilnError(
                f"{function}: no pipeline artifact there (a directory with pipeline.json); "
                "give one, or the function as MODULE:FUNCTION."
            )
        else:
            self.function = load_function(function) if isinstance(function, str) else function
        models = models or {}
        check_models(self.function, list(models), spec)
        self.max_delay = max_delay_ms / 1e3
        self.sessions: dict[str, Any] = {}
        try:
            for name, model in models.items():
                self.sessions[name] = _open(model)
            if self.manifest is not None:  # stages with a fold kept run it (fold.py)
                self.sessions = fold_sessions(self.sessions, self.manifest, Path(function))
        except BaseException:
            self.close()
            raise
        self.last_run: StreamsRun | None = None
        # Stages whose calls run apart: a batch measured no faster per sample (merging.py).
        merges = (self.manifest or {}).get("merging", {})
        self.apart = frozenset(n for n, m in merges.items() if not m.get("merge", True))

    def __call__(self, value: Any) -> Any:
        return call_function(self.function, value, 0, self.sessions)

    def map(self, inputs: Iterable[Any], streams: int = 1) -> list[Any]:
        """Each input's result, in order; `streams` inputs in flight at once. The run's
        per-stage statistics are kept in `last_run`."""
        self.last_run = run_streams(
            self.function, self.sessions, inputs, streams, self.max_delay, self.apart
        )
        return self.last_run.results

    def close(self) -> None:
        for session in self.sessions.values():
            close = getattr(session, "close", None)
            if close is not None:
                close()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open(model: str | os.PathLike | Any) -> Any:
    if isinstance(model, str | os.PathLike):
        from kiln.runtime import Session

        return Session(str(model))
    return model
