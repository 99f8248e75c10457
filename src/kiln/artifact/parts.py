"""A partitioned artifact: `NAME.kiln/` holding several parts, each a whole artifact of its own
(`parts/PART.kiln`, its own graph, engine, precision and threads) beside the original piece it
was compiled from (`parts/PART.onnx`), and a manifest whose "parts" section says the parts, the
tensors that cross between them and how the placement was chosen.

The section is data; `Pipeline` is what it means when run: parts in dependency order, the
parts of one stage (independent of each other) at once on threads — the engines release the
GIL while they compute. The compiler verifies and times a partitioned build through it and the
runtime serves one through it, so both run the same schedule.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import KilnError

Feeds = dict[str, np.ndarray]
PARTS_DIR = "parts"
# What a part runs: its feeds (exactly its inputs) in, its outputs (in its order) out.
Runner = Callable[[Feeds], list[np.ndarray]]
# (what, part, perf_counter seconds, thread id): "start" and "end" of each part's run.
Event = tuple[str, str, float, int]


@dataclass(frozen=True)
class PartSpec:
    """One part as the manifest records it."""

    name: str
    engine: str
    precision: str
    threads: int  # the cores it was given: intra-op threads of its engine
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    nodes: int = 0  # original nodes it holds

    @property
    def path(self) -> str:
        return f"{PARTS_DIR}/{self.name}.kiln"

    @property
    def piece(self) -> str:
        """The original piece it was compiled from (what `kiln compare` checks it against)."""
        return f"{PARTS_DIR}/{self.name}.onnx"

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["inputs"], data["outputs"] = list(self.inputs), list(self.outputs)
        return {**data, "path": self.path, "piece": self.piece}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PartSpec:
        return cls(
            name=str(data["name"]),
            engine=str(data["engine"]),
            precision=str(data["precision"]),
            threads=int(data["threads"]),
            inputs=tuple(data["inputs"]),
            outputs=tuple(data["outputs"]),
            nodes=int(data.get("nodes", 0)),
        )


@dataclass
class PartsSection:
    """The manifest's "parts": the parts in dependency order, each crossing tensor (from which
    part to which, its bytes on the reference inputs) and the placement's record (predicted and
    measured times, every part's time on every engine, why it was chosen)."""

    parts: list[PartSpec]
    crossings: list[dict[str, Any]] = field(default_factory=list)
    placement: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "parts": [p.to_json() for p in self.parts],
            "crossings": self.crossings,
            "placement": self.placement,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PartsSection:
        parts = [PartSpec.from_json(p) for p in data["parts"]]
        return cls(parts, list(data.get("crossings") or []), dict(data.get("placement") or {}))


def stages(parts: Sequence[PartSpec], given: Sequence[str]) -> list[list[PartSpec]]:
    """The parts grouped into stages: each stage's parts read only the model's inputs
    (`given`) and earlier stages' outputs, so they can run at once. KilnError when some part
    can never run (an input nobody makes)."""
    known, left, out = set(given), list(parts), []
    while left:
        ready = [p for p in left if set(p.inputs) <= known]
        if not ready:
            missing = sorted({i for p in left for i in p.inputs} - known)
            raise KilnError(f"the parts need tensors no part makes: {missing}.")
        out.append(ready)
        left = [p for p in left if p not in ready]
        known |= {o for p in ready for o in p.outputs}
    return out


class Pipeline:
    """Runs parts stage by stage; the parts of a stage at once (all but one on a thread pool,
    the last on the calling thread: one hand-off fewer). `on_event(what, part)` is called on
    each part's start and end (before and after its engine runs) on the thread running it;
    the last run's events, with times and threads, are kept in `events`."""

    def __init__(
        self,
        parts: Sequence[PartSpec],
        runners: dict[str, Runner],
        given: Sequence[str],
        on_event: Callable[[str, str], None] | None = None,
    ) -> None:
        self.stages = stages(parts, given)
        self._runners = runners
        self._on_event = on_event
        width = max(len(s) for s in self.stages) if self.stages else 1
        self._pool = ThreadPoolExecutor(max(width - 1, 1), thread_name_prefix="kiln-part")
        self._lock = threading.Lock()
        self.events: list[Event] = []

    def run(self, feeds: Feeds) -> Feeds:
        """Every tensor computed (and the feeds): the model's outputs are among them."""
        values, events = dict(feeds), []
        for stage in self.stages:
            pending = [self._pool.submit(self._part, p, values, events) for p in stage[:-1]]
            results = [self._part(stage[-1], values, events)]
            results += [f.result() for f in pending]  # re-raises a part's error here
            for produced in results:
                values.update(produced)
        with self._lock:
            self.events = events
        return values

    def _part(self, part: PartSpec, values: Feeds, events: list[Event]) -> Feeds:
        feeds = {name: values[name] for name in part.inputs}
        self._mark("start", part.name, events)
        try:
            outputs = self._runners[part.name](feeds)
        finally:
            self._mark("end", part.name, events)
        return dict(zip(part.outputs, outputs, strict=True))

    def _mark(self, what: str, part: str, events: list[Event]) -> None:
        events.append((what, part, time.perf_counter(), threading.get_ident()))
        if self._on_event is not None:
            self._on_event(what, part)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def read_parts(path: Path) -> PartsSection | None:
    """The "parts" section of the artifact at `path`, or None when it is a single-part one (or
    not an artifact: the reader that follows says so)."""
    try:
        data = json.loads((Path(path) / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not data.get("parts"):
        return None
    try:
        return PartsSection.from_json(data["parts"])
    except (KeyError, TypeError, ValueError) as exc:
        raise KilnError(
            f"{path}/manifest.json: corrupted parts section ({type(exc).__name__}: {exc}). "
            "Rebuild it with kiln optimize --partition."
        ) from None


def is_partitioned(path: str | Path) -> bool:
    """Whether `path` is an artifact directory of several parts."""
    path = Path(path)
    return path.is_dir() and read_parts(path) is not None


def one_part_only(path: Path, section: PartsSection) -> KilnError:
    """The error of a verb that runs one graph on one engine, given a partitioned artifact."""
    placed = ", ".join(f"{p.name} on {p.engine}/{p.precision}" for p in section.parts)
    first = section.parts[0]
    return KilnError(
        f"{path} is a partitioned artifact ({placed}): this verb takes one part at a time, "
        f"e.g. {path}/{first.path} (its original piece: {path}/{first.piece}); kiln.Session "
        "and kiln run run the whole."
    )
