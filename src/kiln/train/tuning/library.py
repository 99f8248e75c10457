"""What the training tuner learns from and leaves behind: the winners of the nearest models on
this training hardware class tried first, and the outcome recorded in kiln tune's strategy
library."""

from __future__ import annotations

from typing import Any

from kiln.train.config import TrainConfig
from kiln.train.tuning.job import Job
from kiln.train.tuning.search import Search
from kiln.train.tuning.space import seeds


def training_class() -> dict[str, Any]:
    """This machine as the library keys training records: its own class, so that inference
    studies (keyed by the plain hardware class) never warm-start from them."""
    from kiln.tune.signature import hardware

    machine = hardware()
    return {**machine, "class": f"train:{machine['class']}"}


def warm_queue(search: Search, library: Any, signature: dict[str, Any], objective: str,
               warm_start: bool) -> list[str]:  # fmt: skip
    """Queue the base, then (`warm_start`) the winners of the nearest models on this
    training class; who they were."""
    base = search.space.base_params
    if search.space.key(search.space.base) not in search.seen:
        search.queue.append(base)
    if not warm_start:
        return []
    warm = []
    for distance, record in library.nearest(signature, training_class()["class"],
                                            f"train-{objective}"):  # fmt: skip
        params = {**base, **search.space.project(record.params)}
        if params != base:
            search.queue.append(params)
            warm.append(f"{record.model} (distance {distance:.2f})")
    if warm:
        search.say(f"warm start from the winners of {', '.join(warm)}")
    search.queue.extend(seeds(search.space))
    return warm


def remember(library: Any, job: Job, params: dict[str, Any], config: TrainConfig,
             gains: dict[str, Any], count: int) -> int:  # fmt: skip
    """The study's outcome in the strategy library, under the training hardware class."""
    from kiln.tune.library import Record

    kept = {"verdict": gains["verdict"]}
    if gains.get("speedup"):
        kept["speedup"] = gains["speedup"]
    record = Record(kind="study", hardware=training_class(), model=job.specs["model"] or "",
                    signature=job.signature, objective=f"train-{job.objective}", params=params,
                    config=config.to_json(), gains=kept, pareto=[],
                    evidence={"study": job.study, "trials": count, "data": job.specs["data"],
                              "global_batch": job.space.global_batch})  # fmt: skip
    return library.add(record)
