"""`kiln.Session` on a partitioned artifact: each part opened on its own engine with the
settings its own manifest records (its share of the cores among them), and run through the
artifact's `Pipeline` — parts in dependency order, the independent ones at once.

What a single-part session adds on top of the engine (shape buckets, background rebuilds,
the feedback loop, engine option overrides) is not offered here yet: asking for it is refused
with a message saying so, rather than silently ignored. What `kiln serve` needs of a session
is here (`run_batch`, `check_feeds`, `batch_dims`, `stats`): a batch runs its requests one
after another through the parts, and `stats` gives every part's recent times beside the whole's.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from kiln.artifact.manifest import Manifest
from kiln.artifact.parts import Event, PartSpec, Pipeline
from kiln.artifact.store import read_partitioned
from kiln.backends import (
    Executable,
    get_backend,
    join_company,
    leave_company,
    options_from_json,
)
from kiln.errors import KilnError
from kiln.runtime.arguments import checked_feeds, output_list
from kiln.runtime.metadata import NodeArg, graph_inputs, kserve_meta, node_arg
from kiln.runtime.monitor import percentile_ms
from kiln.runtime.padding import batch_dims, input_layout

Feeds = dict[str, np.ndarray]
# Runs whose times `stats` keeps, per part and for the whole: its percentiles are recent ones.
RECENT_RUNS = 1000
# What a partitioned session does not do yet, by LocalSession keyword (and kiln.Session's).
_NOT_YET = {
    "buckets": "shape buckets",
    "warmup": "bucket warm-up",
    "adaptive": "adaptive rebuilds",
    "options": "engine option overrides (each part records its own)",
    "feedback": "the feedback loop",
    "keep_requests": "request replay",
    "backend": "another backend (each part records its own)",
    "providers": "providers (each part records its engine)",
    "sess_options": "sess_options (each part records its threads)",
    "provider_options": "provider_options",
}


class PartitionedSession:
    """Runs a partitioned artifact: `run(output_names, feeds)` as `LocalSession.run`; the
    settings only a LocalSession takes are refused, one clear message each.

    `on_event(what, part)` is called on the thread running a part as it starts ("start") and
    ends ("end"); `events` holds the last run's (what, part, perf_counter seconds, thread id).
    """

    def __init__(
        self,
        path: str | Path,
        *,
        on_event: Callable[[str, str], None] | None = None,
        **settings: Any,
    ) -> None:
        self._where = str(path)
        _refuse(self._where, settings)
        whole, self.section, parts = read_partitioned(path)
        self.artifact = whole
        self.interface = interface_of(whole.manifest)
        self.executables: dict[str, Executable] = {}
        self._whole: deque[float] = deque(maxlen=RECENT_RUNS)
        self._times: dict[str, deque[float]] = {}
        runners = {}
        for spec in self.section.parts:
            recorded = parts[spec.name].manifest.backend
            exe = get_backend(recorded.name).compile(
                str(parts[spec.name].model_path), options_from_json(recorded.name, recorded.options)
            )
            join_company(exe)  # a part on another engine is company for an ORT pool
            self.executables[spec.name] = exe
            self._times[spec.name] = deque(maxlen=RECENT_RUNS)
            runners[spec.name] = _timed(exe.run, self._times[spec.name])
        self._requests = 0
        self._count = threading.Lock()
        self._pipeline = Pipeline(self.section.parts, runners, self.input_names, on_event)
        self._outputs = [v.name for v in self.interface.graph.outputs]

    # ------------------------------------------------------------------ interface

    @property
    def parts(self) -> list[PartSpec]:
        return list(self.section.parts)

    @property
    def input_names(self) -> list[str]:
        return [v.name for v in graph_inputs(self.interface)]

    @property
    def output_names(self) -> list[str]:
        return list(self._outputs)

    def get_inputs(self) -> list[NodeArg]:
        return [node_arg(v) for v in graph_inputs(self.interface)]

    def get_outputs(self) -> list[NodeArg]:
        return [node_arg(v) for v in self.interface.graph.outputs]

    def get_providers(self) -> list[str]:
        return sorted({p for exe in self.executables.values() for p in exe.providers})

    @property
    def inputs(self) -> list[dict[str, Any]]:
        return [kserve_meta(v) for v in graph_inputs(self.interface)]

    @property
    def outputs(self) -> list[dict[str, Any]]:
        return [kserve_meta(v) for v in self.interface.graph.outputs]

    @property
    def buckets(self) -> dict[str, list[int]]:
        """None: every part runs its inputs' own shapes."""
        return {}

    @property
    def batch_dims(self) -> list[str]:
        """The dims that are a batch of independent items (axis 0 only)."""
        return sorted(batch_dims(input_layout(self.interface)))

    @property
    def events(self) -> list[Event]:
        """The last run's part starts and ends: (what, part, perf_counter s, thread id)."""
        return list(self._pipeline.events)

    # ------------------------------------------------------------------ running

    def run(
        self, output_names: list[str] | None, feeds: Feeds, run_options: Any = None
    ) -> list[np.ndarray]:
        """As LocalSession.run: the outputs named (None: all), in order."""
        names = output_list(output_names, self._outputs, self._where)
        if run_options is not None:
            raise KilnError(f"{self._where}: run_options are not taken by a partitioned artifact.")
        checked = checked_feeds(feeds, self.interface, self._where)
        started = time.perf_counter()
        values = self._pipeline.run(checked)
        self._whole.append(time.perf_counter() - started)
        with self._count:
            self._requests += 1
        return [values[n] for n in names]

    def run_batch(
        self, requests: list[Feeds], output_names: list[str] | None = None
    ) -> list[list[np.ndarray]]:
        """Each request's outputs, in order: the requests run one after another (each part
        already has its share of the cores; stacking requests across parts is not done)."""
        return [self.run(output_names, feeds) for feeds in requests]

    def check_feeds(self, feeds: Feeds) -> Feeds:
        """The feeds checked against the model's inputs, as `run` checks them: what a server
        checks before it queues a request."""
        return checked_feeds(feeds, self.interface, self._where)

    def stats(self) -> dict[str, Any]:
        """Requests run, and P50/P99 of the recent runs of the whole and of every part (its
        engine's time on its inputs), in ms. No buckets, rebuilds or swaps: none are made."""
        return {
            "requests": self._requests,
            "swaps": 0,
            "recompiles": 0,
            "decisions": [],
            "buckets": {},
            "whole": _percentiles(self._whole),
            "parts": {name: _percentiles(times) for name, times in self._times.items()},
        }

    def swap(self, *args: Any, **kwargs: Any) -> None:
        raise KilnError(
            f"{self._where} is a partitioned artifact: it has no shape buckets to rebuild or "
            "swap; build it with --partition none for a bucketed session."
        )

    def close(self) -> None:
        self._pipeline.close()
        for executable in self.executables.values():
            leave_company(executable)

    def __enter__(self) -> PartitionedSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def interface_of(manifest: Manifest) -> ir.Model:
    """The whole model's inputs and outputs (no nodes), from the manifest: what requests are
    checked against, and what synthesized inputs are made from (at the recorded dims)."""

    def value(spec: dict[str, Any]) -> ir.Value:
        dtype = ir.DataType.from_numpy(np.dtype(spec["dtype"]))
        return ir.Value(name=spec["name"], type=ir.TensorType(dtype), shape=ir.Shape(spec["shape"]))

    graph = ir.Graph(
        [value(s) for s in manifest.inputs],
        [value(s) for s in manifest.outputs],
        nodes=[],
        opset_imports={"": 17},
        name=manifest.source.name,
    )
    model = ir.Model(graph, ir_version=8)
    model.metadata_props["kiln.dims"] = _dims_json(manifest.dims)
    return model


def _dims_json(dims: dict[str, int]) -> str:
    import json

    return json.dumps(dims)


def _timed(
    run: Callable[[Feeds], list[np.ndarray]], times: deque[float]
) -> Callable[[Feeds], list[np.ndarray]]:
    def timed(feeds: Feeds) -> list[np.ndarray]:
        started = time.perf_counter()
        outputs = run(feeds)
        times.append(time.perf_counter() - started)
        return outputs

    return timed


def _percentiles(times: deque[float]) -> dict[str, float | int]:
    recent = times.copy()  # one step under the GIL, as appends are
    if not recent:
        return {"runs": 0}
    return {"runs": len(recent), "p50_ms": percentile_ms(recent, 50),
            "p99_ms": percentile_ms(recent, 99)}  # fmt: skip


def _refuse(where: str, settings: dict[str, Any]) -> None:
    """LocalSession settings a partitioned artifact does not take yet: one clear error each."""
    given = {k: v for k, v in settings.items() if v not in (None, False, 0, {}, [], "")}
    given.pop("share_weights", None)  # a memory choice of ORT buckets: nothing to share here
    given.pop("steady", None)
    for key in given:
        what = _NOT_YET.get(key, f"'{key}'")
        raise KilnError(
            f"{where} is a partitioned artifact: kiln.Session does not offer {what} on one "
            "yet. Open it without, or build it with --partition none."
        )
