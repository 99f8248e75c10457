"""The reference run: the pipeline function over the data with every model as it is, each model
call's feeds, outputs and time kept.

What it yields is what the stages are compiled from: an inner model's calibration set is the
feeds it really received (the crops a recogniser saw, not hand-made data), its shape buckets the
shapes it was called with, and the time in each model against the time in the glue says where a
query's time goes.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kiln.errors import KilnError
from kiln.pipeline.function import PipelineFunction, stage_failed, user_error
from kiln.pipeline.ops import Trace, remember, trace_of

Feeds = dict[str, np.ndarray]


@dataclass
class Call:
    """One model call of the reference run."""

    model: str
    query: int  # which input of the data it served
    feeds: Feeds
    outputs: list[np.ndarray]
    seconds: float
    # Kiln ops (ops.py) seen around the call, what fold.py folds: per feed, the array its
    # chain started from and the chain; per output, every chain the glue built on it.
    pre: dict[str, tuple[np.ndarray, tuple]] = field(default_factory=dict)
    post: dict[str, list[tuple]] = field(default_factory=dict)


@dataclass
class Recording:
    """The reference run over the data: every call, each input's result and time."""

    calls: list[Call] = field(default_factory=list)
    results: list[Any] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)  # per input, end to end

    def of(self, model: str) -> list[Call]:
        return [call for call in self.calls if call.model == model]

    def feeds(self, model: str) -> list[Feeds]:
        """The calibration set of `model`: the feeds it received, in order."""
        return [call.feeds for call in self.of(model)]

    def shapes(self, model: str) -> dict[str, Counter[tuple[int, ...]]]:
        """Per input of `model`, how often each shape was fed."""
        counts: dict[str, Counter[tuple[int, ...]]] = {}
        for call in self.of(model):
            for name, array in call.feeds.items():
                counts.setdefault(name, Counter())[tuple(array.shape)] += 1
        return counts

    def model_seconds(self) -> dict[str, float]:
        """Time in each model over the whole run."""
        total: dict[str, float] = {}
        for call in self.calls:
            total[call.model] = total.get(call.model, 0.0) + call.seconds
        return total

    def glue_seconds(self) -> float:
        """Time outside every model: the function's own pre- and post-processing."""
        return max(sum(self.seconds) - sum(self.model_seconds().values()), 0.0)


class RecordedModel:
    """A session as the pipeline function sees it during the reference run: it runs as the
    session does and keeps each call (copies of the feeds, the outputs, the time)."""

    def __init__(self, name: str, session: Any, recording: Recording, query: Callable[[], int]):
        self.name, self.session = name, session
        self._recording, self._query = recording, query

    def run(self, output_names: list[str] | None, feeds: Mapping[str, Any], *args: Any) -> Any:
        kept = {name: np.array(value, copy=True) for name, value in feeds.items()}
        start = time.perf_counter()
        outputs = self.session.run(output_names, feeds, *args)
        seconds = time.perf_counter() - start
        call = Call(self.name, self._query(), kept, [np.asarray(o) for o in outputs], seconds)
        self._recording.calls.append(call)
        for name, value in feeds.items():
            trace = trace_of(value)
            if trace is not None:
                call.pre[name] = (np.array(trace.root, copy=True), trace.steps)
        names = output_names or [o.name for o in getattr(self.session, "get_outputs", list)()]
        for name, value in zip(names, outputs, strict=False):
            if isinstance(value, np.ndarray) and trace_of(value) is None:
                remember(value, Trace(value, sink=call.post.setdefault(name, [])))
        return outputs

    def __getattr__(self, name: str) -> Any:  # get_inputs, get_outputs, ... as the session has
        return getattr(self.session, name)


def record(
    function: PipelineFunction, sessions: Mapping[str, Any], data: Iterable[Any]
) -> Recording:
    """Run `function` on each input of `data` with `sessions` as its models, recording. A model
    that fails names itself and the input; the function's own exception names the place in
    the user's file; an empty data set is refused."""
    recording = Recording()
    index = 0
    models = {
        name: RecordedModel(name, session, recording, lambda: index)
        for name, session in sessions.items()
    }
    for index, value in enumerate(data):  # noqa: B007 (the models read `index` through the lambda)
        start = time.perf_counter()
        recording.results.append(call_function(function, value, index, models))
        recording.seconds.append(time.perf_counter() - start)
    if not recording.results:
        raise KilnError("the data set is empty: the pipeline needs at least one input to record.")
    return recording


def call_function(function: PipelineFunction, value: Any, index: int, models: Mapping[str, Any]):
    """`function(value, **models)`; what fails inside becomes one KilnError line: the model that
    failed and the input, or the place in the user's code."""
    try:
        return function(value, **models)
    except Exception as exc:
        model = _failed_model(exc, models)
        if model is not None:
            raise stage_failed(model, exc, index, value) from None
        if isinstance(exc, KilnError):
            raise
        raise KilnError(
            f"the pipeline function failed on input {index}: {user_error(exc)}"
        ) from None


def _failed_model(exc: BaseException, models: Mapping[str, Any]) -> str | None:
    """The model whose `run` raised `exc`, if one did: its frame is in the traceback."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == "run":
            owner = tb.tb_frame.f_locals.get("self")
            for name, model in models.items():
                if owner is model:
                    return name
        tb = tb.tb_next
    return None
