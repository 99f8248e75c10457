"""Which stage's choice changed a pipeline's output.

The function runs over the data three ways, sequentially and recorded (recording.py):
- with every stage at its fp32 source model: the reference, the fp32 pipeline;
- with every stage at its chosen artifact, as the artifact runs;
- per stage, with that stage alone back at its fp32 source and the others at their choices.
A stage's choice changed an input's result where the last two differ on it: putting that stage
back is what changes it. Per stage: the metric against the fp32 pipeline with it put back, the
inputs its choice changes (the first few, with the largest difference between its calls'
outputs in the two runs: its own error on that input), and one line naming the stage that
moved the result most.

The chosen stages run as their artifacts without any fold (fold.py): a fold is verified equal
to the artifact it extends, and the comparison is about the choices.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from kiln.errors import KilnError
from kiln.pipeline.data import exact, load_data, load_metric
from kiln.pipeline.function import described
from kiln.pipeline.pipeline_artifact import read_pipeline
from kiln.pipeline.recording import Recording, record

Say = Callable[[str], None]
SHOWN = 5  # inputs listed per stage


def compare_pipeline(
    artifact: str | os.PathLike,
    data: str | Sequence[Any],
    metric: str | None = None,
    shown: int = SHOWN,
    say: Say | None = None,
) -> dict[str, Any]:
    """Per stage, what putting it back at fp32 changes; JSON-ready. `metric` defaults to the
    one the artifact was compiled with (exact where that was a Python object)."""
    from kiln.runtime import Session

    say = say or (lambda line: None)
    function, paths, manifest = read_pipeline(artifact)
    inputs = load_data(data)
    name, score = _metric(metric, manifest)
    stages = manifest["stages"]
    say("opening the fp32 sources and the chosen stages")
    fp32 = {n: Session(str(s["source"])) for n, s in stages.items()}
    chosen = {n: Session(str(p)) for n, p in paths.items()}
    try:
        found = _compare(function, fp32, chosen, inputs, manifest, name, score, shown, say)
        return {"artifact": str(artifact), **found}
    finally:
        for session in [*fp32.values(), *chosen.values()]:
            session.close()


def _compare(
    function: Any, fp32: dict[str, Any], chosen: dict[str, Any], inputs: list[Any],
    manifest: Mapping[str, Any], name: str, score: Callable[[list, list], float], shown: int,
    say: Say,
) -> dict[str, Any]:  # fmt: skip
    stages = manifest["stages"]
    say("the fp32 pipeline")
    reference = record(function, fp32, inputs)
    say("the chosen stages")
    picked = record(function, chosen, inputs)
    out: dict[str, Any] = {
        "metric": name,
        "inputs": len(inputs),
        "fp32": score(reference.results, reference.results),
        "chosen": score(reference.results, picked.results),
        "differ": len(_changed(reference.results, picked.results)),
        "stages": {},
    }
    for stage in stages:
        say(f"stage {stage} back at fp32")
        back = record(function, {**chosen, stage: fp32[stage]}, inputs)
        out["stages"][stage] = _stage(stage, stages[stage]["precision"], picked, back,
                                      reference, score, inputs, shown)  # fmt: skip
    out["moved_most"], out["verdict"] = _verdict(out)
    return out


def _changed(before: list[Any], after: list[Any]) -> list[int]:
    """The inputs whose result differs between two runs."""
    pairs = enumerate(zip(before, after, strict=True))
    return [i for i, (a, b) in pairs if exact([a], [b]) < 1.0]


def _metric(metric: str | None, manifest: Mapping[str, Any]):
    if metric is not None:
        return load_metric(metric)
    try:
        return load_metric(manifest["metric"]["name"])
    except KilnError:  # a metric given as a Python object in compile_pipeline: not reloadable
        return load_metric("exact")


def _stage(
    stage: str, precision: str, picked: Recording, back: Recording, reference: Recording,
    score: Callable[[list, list], float], inputs: list[Any], shown: int,
) -> dict[str, Any]:  # fmt: skip
    changed = _changed(picked.results, back.results)
    return {
        "precision": precision,
        "metric_with_it_at_fp32": score(reference.results, back.results),
        "changed": len(changed),
        "first": [
            {"input": i, "value": described(inputs[i]), **_largest(stage, i, picked, back)}
            for i in changed[:shown]
        ],
    }


def _largest(stage: str, query: int, picked: Recording, back: Recording) -> dict[str, Any]:
    """The largest absolute difference between the stage's outputs on one input, its calls
    paired in order (a later call may see other feeds: the glue took another branch)."""
    mine = [c for c in picked.of(stage) if c.query == query]
    theirs = [c for c in back.of(stage) if c.query == query]
    largest = 0.0
    for a, b in zip(mine, theirs, strict=False):
        for x, y in zip(a.outputs, b.outputs, strict=False):
            if x.shape != y.shape:
                return {"calls": [len(mine), len(theirs)], "max_abs_diff": None}
            if x.size and np.issubdtype(x.dtype, np.number):
                diff = np.abs(x.astype(np.float64) - y.astype(np.float64))
                largest = max(largest, float(diff.max()))
    return {"calls": [len(mine), len(theirs)], "max_abs_diff": largest}


def _verdict(out: dict[str, Any]) -> tuple[str | None, str]:
    stages = out["stages"]
    if not stages or not out["differ"]:
        return None, "every input's result equals the fp32 pipeline's: no choice changed one"
    best = max(stages, key=lambda n: (stages[n]["metric_with_it_at_fp32"], stages[n]["changed"]))
    s = stages[best]
    if not s["changed"]:
        return None, (
            f"{out['differ']} of {out['inputs']} results differ from the fp32 pipeline's, but "
            "no stage put back alone changes one: the choices act together"
        )
    return best, (
        f"stage {best} moved the result most: {out['metric']} {out['chosen']:.4g} with every "
        f"choice, {s['metric_with_it_at_fp32']:.4g} with {best} back at fp32 "
        f"(its {s['precision']} changes {s['changed']} of {out['inputs']} results)"
    )
