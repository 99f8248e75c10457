"""Never behind a hand recipe: each recipe a user could run with an engine's own tools is a
candidate of `--precision auto` and a first trial of `kiln tune`, rebuilt from its manifest;
among candidates within noise of the fastest, the one with the lowest P99 is chosen."""

from __future__ import annotations

from pathlib import Path

import onnx_ir as ir
import pytest

import kiln
from kiln import zoo
from kiln.compiler.candidate import config_label
from kiln.compiler.select import candidates, fastest
from kiln.config import HAND, RECIPES, CompileConfig, read_config
from kiln.precision import ENGINES_FOR, has_hand_recipe
from kiln.tune import parse_objectives, plan_for
from kiln.tune.space import Space, choice_of, project, recipe_params


def test_precision_auto_lists_every_hand_recipe_on_the_original_graph():
    listed = candidates(CompileConfig(engine="auto", precision="auto"))
    recipes = [c for c in listed if c.recipe is not None]
    expected = {
        (e, p) for e, p in set(RECIPES.values()) if e in {c.engine for c in listed}
        and has_hand_recipe(e, p)
    }  # fmt: skip
    assert {(c.engine, c.precision) for c in recipes} == expected
    assert all(c.recipe == HAND and c.pipeline == () for c in recipes)
    assert all(config_label(c).endswith(" hand") for c in recipes)
    assert len({config_label(c) for c in listed}) == len(listed)  # names never collide
    # A fixed precision is the user's: no recipe is added behind their back.
    assert all(c.recipe is None for c in candidates(CompileConfig(precision="int8")))


def test_bf16_has_a_recipe_only_where_the_engine_has_bf16_kernels():
    from kiln.precision import no_bf16_kernels

    assert has_hand_recipe("openvino", "bf16") == (no_bf16_kernels("openvino") is None)
    assert not has_hand_recipe("ort", "fp32")


def test_a_recipe_compiles_verifies_and_its_manifest_rebuilds_it(tmp_path):
    artifact = kiln.compile("zoo:bert-tiny", tmp_path / "r.kiln", backend="ort",
                            precision="int8", recipe=HAND, rounds=0)  # fmt: skip
    manifest = artifact.manifest
    assert manifest.verification.ok
    config = manifest.config
    # bert-tiny is MatMul-heavy: by hand a user runs ORT's quantize_dynamic
    assert (config.recipe, config.pipeline) == ("ort-dynamic", ())
    assert manifest.precision["recipe"]["name"] == "ort-dynamic"
    assert manifest.passes == [] or all(p.name == "quantize-int8" for p in manifest.passes)
    read, source = read_config(artifact.path)
    again = kiln.compile(source, tmp_path / "again.kiln", config=read)
    assert again.manifest.config == config
    assert again.manifest.precision["recipe"] == manifest.precision["recipe"]


def test_a_recipe_is_for_its_own_engine_and_the_original_graph():
    with pytest.raises(kiln.KilnError, match="recipe 'nncf-transformer' is openvino int8"):
        CompileConfig(engine="ort", precision="int8", recipe="nncf-transformer")
    with pytest.raises(kiln.KilnError, match="runs on the original graph"):
        CompileConfig(recipe="ort-dynamic", pipeline=("fuse-gelu",))
    with pytest.raises(kiln.KilnError, match="unknown recipe 'by-hand'"):
        CompileConfig(recipe="by-hand")


def test_a_study_enqueues_the_hand_recipes_first():
    model = ir.serde.deserialize_model(zoo.build("bert-tiny"))
    space = Space(("ort", "openvino"), ("fp32", "bf16", "int8", "int4"), cores=2)
    recipes = recipe_params(space)
    pairs = {(p["engine"], p[f"{p['engine']}.precision"]) for p in recipes}
    assert pairs == {
        (e, p) for e in space.engines for p in space.precisions
        if e in ENGINES_FOR[p] and has_hand_recipe(e, p)
    }  # fmt: skip
    chosen = {
        choice_of(project(p, space, model, CompileConfig()), space, model, CompileConfig())
        .config.recipe
        for p in recipes
    }  # fmt: skip
    assert {"ort-dynamic", "nncf-transformer"} <= chosen


def test_the_recipes_are_the_first_trials_of_a_study(monkeypatch):
    import optuna

    import kiln.tune.study as study_module

    enqueued: list[dict] = []
    monkeypatch.setattr(
        optuna.study.Study, "enqueue_trial",
        lambda self, params, **_: enqueued.append(params),
    )  # fmt: skip
    monkeypatch.setattr(study_module, "_run", lambda *a, **k: (_ for _ in ()).throw(_Stop()))
    plan = plan_for(
        "zoo:bert-tiny", objectives=parse_objectives(["latency"]), constraints=[],
        base=CompileConfig(), trials=2, timeout_s=None, url=None, study="recipes-first",
        engines=["ort"], precisions=["fp32", "int8"],
    )  # fmt: skip
    with pytest.raises(_Stop):
        study_module.tune(plan, None, say=lambda _m: None, warm_start=False)
    # Kiln's defaults first (the pick is measured against them), then the recipe.
    assert enqueued[0]["engine"] == "ort" and enqueued[0]["ort.precision"] == "fp32"
    assert enqueued[1].get("ort.int8.recipe") == "hand"
    assert all(p.get("ort.int8.recipe") != "hand" for p in enqueued[2:])


class _Stop(Exception):
    """Stops a study once its first trials are enqueued."""


def _timed(
    speedup: float, spread: tuple[float, float] | None, p99: float, verdict: str = "faster"
) -> dict:
    return {"speedup": speedup, "speedup_spread": list(spread) if spread else None,
            "verdict": verdict, "p50_ms": 1.0 / speedup, "p99_ms": p99}  # fmt: skip


class _Result:
    """What `fastest` reads of a CompileResult: its label."""

    def __init__(self, label: str) -> None:
        self.label = label


def _timing(candidates: dict[str, dict]) -> dict:
    return {"rounds": 5, "runs_per_round": 10, "original_ort": {}, "candidates": candidates}


def test_within_noise_of_the_fastest_the_lower_p99_is_chosen_and_said():
    timing = _timing({
        "ort/int8": _timed(2.00, (1.80, 2.20), p99=5.0),
        "openvino/int8 hand:nncf-transformer": _timed(1.95, (1.75, 2.15), p99=3.0),
        "ort/fp32": _timed(1.10, (1.05, 1.15), p99=1.0),  # lowest P99, but slower beyond noise
    })  # fmt: skip
    results = [_Result(name) for name in timing["candidates"]]
    chosen, bench = fastest(results, timing)
    assert chosen.label == "openvino/int8 hand:nncf-transformer"
    assert bench["choice"] == chosen.label and bench["speedup"] == 1.95
    assert "lowest P99" in bench["choice_reason"] and "ort/int8" in bench["choice_reason"]


def test_beyond_noise_the_faster_is_chosen_whatever_its_p99():
    timing = _timing({
        "ort/int8": _timed(2.00, (1.95, 2.05), p99=5.0),
        "openvino/int8": _timed(1.60, (1.55, 1.65), p99=3.0),
    })  # fmt: skip
    chosen, bench = fastest([_Result(n) for n in timing["candidates"]], timing)
    assert chosen.label == "ort/int8"
    assert bench["choice_reason"].startswith("the fastest verified candidate")
    assert "no other within noise" in bench["choice_reason"]


def test_a_pick_called_faster_is_not_swapped_for_one_no_different_from_the_original():
    timing = _timing({
        "ort/int8": _timed(1.30, (1.05, 1.50), p99=5.0),
        "ort/fp32": _timed(1.10, (0.95, 1.25), p99=1.0, verdict="no different within noise"),
    })  # fmt: skip
    chosen, bench = fastest([_Result(n) for n in timing["candidates"]], timing)
    assert chosen.label == "ort/int8" and bench["verdict"] == "faster"


def test_unknown_spreads_tell_nothing_apart_so_the_fastest_wins():
    timing = _timing({"ort/int8": _timed(2.0, None, 5.0), "ort/fp32": _timed(1.99, None, 1.0)})
    chosen, _ = fastest([_Result(n) for n in timing["candidates"]], timing)
    assert chosen.label == "ort/int8"


@pytest.mark.slow
def test_the_nncf_transformer_recipe_compiles_on_the_original_graph(tmp_path: Path):
    artifact = kiln.compile("zoo:bert-tiny", tmp_path / "n.kiln", backend="openvino",
                            precision="int8", recipe=HAND, rounds=0)  # fmt: skip
    assert artifact.manifest.verification.ok
    assert artifact.manifest.config.recipe == "nncf-transformer"
    assert artifact.manifest.precision["recipe"]["tool"].endswith("TRANSFORMER preset")
