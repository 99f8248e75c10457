"""`kiln profile` of a partitioned artifact: every part profiled on the tensors it really
receives (the whole model's synthesized inputs run through the parts before it), beside the
end-to-end latency of the parts run on the schedule `kiln.Session` runs them on (the artifact's
Pipeline: independent parts at once)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from kiln.artifact.parts import PartSpec, Pipeline
from kiln.artifact.store import read_partitioned
from kiln.backends import get_backend, options_from_json
from kiln.ir.inputs import default_dims, synthesize
from kiln.profile.run import profile_model
from kiln.profile.target import BATCH_DIMS
from kiln.timing import stats

Feeds = dict[str, np.ndarray]


def profile_parts(
    source: str,
    *,
    batch: int = 1,
    runs: int = 20,
    rounds: int = 5,
    peaks: Any = None,
    say: Callable[[str], None] = lambda _msg: None,
) -> dict[str, Any]:
    """{"parts": {name: profile_model's dict}, "end_to_end": latency, "placement": ...}."""
    if peaks is None:
        from kiln.hardware import measured_peaks

        peaks = measured_peaks(progress=lambda step: say(f"measuring this machine: {step}"))
    whole, section, artifacts = read_partitioned(source)
    runners = {}
    for spec in section.parts:
        recorded = artifacts[spec.name].manifest.backend
        options = options_from_json(recorded.name, recorded.options)
        runners[spec.name] = (
            get_backend(recorded.name).compile(str(artifacts[spec.name].model_path), options).run
        )
    feeds = _whole_inputs(section.parts, artifacts, whole.manifest.dims, batch)
    pipeline = Pipeline(section.parts, runners, list(feeds))
    try:
        say("running the parts once for the tensors each receives")
        values = pipeline.run(feeds)  # also the warm-up
        say("timing the whole on kiln.Session's schedule")
        latency = []
        for _ in range(runs):
            start = time.perf_counter()
            pipeline.run(feeds)
            latency.append(time.perf_counter() - start)
    finally:
        pipeline.close()
    runners.clear()  # each part's engine session closed before it is profiled on its own
    parts = {}
    for spec in section.parts:
        say(f"profiling part {spec.name} ({spec.engine}/{spec.precision})")
        parts[spec.name] = profile_model(
            str(Path(source) / spec.path), runs=runs, rounds=rounds, peaks=peaks, say=say,
            feeds={n: values[n] for n in spec.inputs},
        )  # fmt: skip
    return {
        "source": source,
        "placement": {
            spec.name: f"{spec.engine}/{spec.precision}, {spec.threads} threads"
            for spec in section.parts
        },
        "end_to_end": stats(latency, batch).to_json(),
        "parts": parts,
    }


def _whole_inputs(
    parts: list[PartSpec], artifacts: dict[str, Any], recorded: dict[str, int] | None, batch: int
) -> Feeds:
    """The whole model's inputs, synthesized from the parts that take them (a tensor no
    earlier part produces), at the dims the artifact recorded and this batch size."""
    feeds: Feeds = {}
    produced: set[str] = set()
    for spec in parts:
        model = ir.load(str(artifacts[spec.name].model_path))  # the graph; weights stay mapped
        dims = {**(recorded or default_dims(model)), **dict.fromkeys(BATCH_DIMS, batch)}
        fresh = [n for n in spec.inputs if n not in produced and n not in feeds]
        if fresh:
            made = synthesize(model, dims)
            feeds.update({n: made[n] for n in fresh})
        produced.update(spec.outputs)
    return feeds
