"""A study's first trial is Kiln's defaults, so even `--trials 3` measures the pick against
them; a resumed study gets them once, only where no trial of them exists yet."""

from __future__ import annotations

import optuna
import pytest

import kiln.tune.study as study_module
from kiln.config import CompileConfig
from kiln.tune import parse_objectives, plan_for
from kiln.tune.space import default_params, project
from kiln.tune.storage import optuna_storage


class _Stop(Exception):
    """Stops `tune` once its first trials are enqueued, before any is measured."""


@pytest.fixture
def plan(monkeypatch):
    monkeypatch.setattr(study_module, "_run", lambda *a, **k: (_ for _ in ()).throw(_Stop()))
    return plan_for(
        "zoo:bert-tiny", objectives=parse_objectives(["latency"]), constraints=[],
        base=CompileConfig(), trials=3, timeout_s=None, url=None, study="seeds",
        engines=["ort"], precisions=["fp32", "int8"],
    )  # fmt: skip


def _start(plan) -> list[dict]:
    """The study's trials' parameters after `tune` enqueued its seeds, in trial order."""
    with pytest.raises(_Stop):
        study_module.tune(plan, None, say=lambda _m: None, warm_start=False)
    storage = optuna_storage(plan.url, plan.heartbeat_s, plan.grace_s)
    study = optuna.load_study(study_name=plan.study, storage=storage)
    return [t.system_attrs.get("fixed_params", t.params) for t in study.trials]


def _defaults(plan) -> dict:
    space = study_module._space(plan)
    model = study_module.load_source(plan.source).model
    return project(default_params(space), space, model, plan.base)


def test_the_first_trial_of_a_study_is_kiln_defaults(plan):
    trials = _start(plan)
    assert trials[0] == _defaults(plan)
    assert trials.count(_defaults(plan)) == 1


def test_a_resumed_study_gets_the_defaults_once(plan):
    storage = optuna_storage(plan.url, plan.heartbeat_s, plan.grace_s)
    study = study_module._study(plan, storage)  # begun with another trial first
    other = {"engine": "ort", "ort.precision": "int8", "ort.int8.recipe": "hand"}
    study.enqueue_trial(other)
    trials = _start(plan)
    assert trials[0] == other and trials[1:] == [_defaults(plan)]
    assert _start(plan) == trials  # resumed again: not twice
