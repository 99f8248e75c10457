"""What every session `kiln.Session(...)` returns can do, whichever kind it is: a model run
here (LocalSession), a partitioned artifact's parts on their engines (PartitionedSession), or
the edge part of a split here and its server part on a server (RemoteSession)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

from kiln.runtime.metadata import NodeArg

Feeds = dict[str, np.ndarray]


@runtime_checkable
class SessionLike(Protocol):
    """As onnxruntime.InferenceSession where the names are the same: `get_inputs`,
    `get_outputs` and `run(output_names, feeds)`; Kiln's `run_batch` (each request's outputs,
    in order), `stats` (requests, latency, and what the session decided) and `close`."""

    @property
    def input_names(self) -> list[str]: ...

    @property
    def output_names(self) -> list[str]: ...

    def get_inputs(self) -> list[NodeArg]: ...

    def get_outputs(self) -> list[NodeArg]: ...

    def run(
        self, output_names: list[str] | None, feeds: Feeds, run_options: Any = None
    ) -> list[np.ndarray]: ...

    def run_batch(
        self, requests: list[Feeds], output_names: list[str] | None = None
    ) -> list[list[np.ndarray]]: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...
