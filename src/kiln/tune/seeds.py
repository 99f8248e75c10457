"""A study's first trials, enqueued before the sampler chooses any: Kiln's defaults, the hand
recipes, the nearest models' winners, then the engines' defaults.

Kiln's defaults go first so that however short the budget (`--trials 3`), the pick is
measured against them within the same search; then the hand recipes, so it is never behind
what a user runs by hand; then what was learnt on other models before what is merely likely.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import onnx_ir as ir

from kiln.config import CompileConfig
from kiln.tune.space import Space, default_params, project, recipe_params, seed_params
from kiln.tune.storage import claim


def kiln_defaults(space: Space, model: ir.Model, base: CompileConfig) -> dict[str, Any] | None:
    """The trial parameters of Kiln's defaults (ORT, fp32), None where the space leaves out
    that engine or precision."""
    if "ort" not in space.engines or "fp32" not in space.precisions:
        return None
    return project(default_params(space), space, model, base)


def enqueue_seeds(
    study: Any,
    space: Space,
    model: ir.Model,
    base: CompileConfig,
    storage: Any,
    url: str,
    nearest: Callable[[], list[tuple[float, Any]]],
    more_trials: bool,
) -> list[str]:
    """Enqueue a new study's first trials once, whichever of the workers started together gets
    there first (the claim is atomic on any database); `nearest` gives the library's (distance,
    record) winners to warm start from. A study resumed without a trial of Kiln's defaults
    (begun before they went first) gets them as its next trial when it has `more_trials` to
    run. Returns the warm-start models, as the report names them."""
    defaults = kiln_defaults(space, model, base)
    if study.trials:
        if defaults is not None and more_trials:  # none, if a trial of them exists
            study.enqueue_trial(defaults, skip_if_exists=True)
        return []
    if not claim(url, f"seeds:{storage.get_study_id_from_name(study.study_name)}"):
        return []
    first = [defaults] if defaults is not None else []
    first += [project(p, space, model, base) for p in recipe_params(space)]
    warm = []
    for distance, record in nearest():
        first.append(project(record.params, space, model, base))
        warm.append(f"{record.model} (distance {distance:.2f})")
    first += [project(p, space, model, base) for p in seed_params(space)]
    for params in first:
        study.enqueue_trial(params, skip_if_exists=True)
    return warm
