"""`kiln profile` of a partitioned artifact: every part profiled on the tensors it really
receives (the whole model's synthesized inputs run through the parts before it), beside the
end-to-end latency of the parts run as `kiln.Session` runs them (independent parts at once)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kiln.artifact.parts import read_parts
from kiln.ir.inputs import default_dims, synthesize
from kiln.profile.run import profile_model
from kiln.profile.target import BATCH_DIMS
from kiln.timing import stats


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
    from kiln.runtime.parts import PartitionedSession

    if peaks is None:
        from kiln.hardware import measured_peaks

        peaks = measured_peaks(progress=lambda step: say(f"measuring this machine: {step}"))
    section = read_parts(Path(source))
    session = PartitionedSession(source)
    try:
        say("running the parts once for the tensors each receives")
        recorded = session.artifact.manifest.dims or default_dims(session.interface)
        dims = {**recorded, **dict.fromkeys(BATCH_DIMS, batch)}
        tensors: dict[str, np.ndarray] = dict(synthesize(session.interface, dims))
        wanted: dict[str, dict[str, np.ndarray]] = {}
        for spec in section.parts:
            feeds = {n: tensors[n] for n in spec.inputs}
            wanted[spec.name] = feeds
            exe = session.executables[spec.name]
            tensors.update(zip(exe.output_names, exe.run(feeds), strict=True))
        whole = {n: tensors[n] for n in session.input_names}
        say("timing the whole, parts at once as kiln.Session runs them")
        session.run(None, whole)  # warm-up
        latency = []
        for _ in range(runs):
            start = time.perf_counter()
            session.run(None, whole)
            latency.append(time.perf_counter() - start)
    finally:
        session.close()
    parts = {}
    for spec in section.parts:
        say(f"profiling part {spec.name} ({spec.engine}/{spec.precision})")
        parts[spec.name] = profile_model(
            str(Path(source) / spec.path), runs=runs, rounds=rounds, peaks=peaks, say=say,
            feeds=wanted[spec.name],
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
