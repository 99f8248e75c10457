"""Memory is a decision: the engines' memory options are CompileConfig engine options that
round-trip through the artifact, and `kiln optimize --max-memory` measures the artifact's peak
and trades time for memory until it fits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mlp_models import WIDTH, write_mlp

import kiln
from kiln.artifact.store import EXTERNAL_THRESHOLD
from kiln.runtime.footprint import peak_memory


def _feeds(width: int, batch: int = 2) -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(0).standard_normal((batch, width)).astype(np.float32)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_mlp(tmp_path_factory.mktemp("tiny") / "tiny.onnx", 2, width=64)


# 5 × 16 MiB: above the size an artifact keeps its weights in a file of their own, where ONNX
# Runtime maps them instead of copying them (the case prepacking changes most).
LAYERS = 5


@pytest.fixture(scope="module")
def mlp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    assert LAYERS * WIDTH * WIDTH * 4 > EXTERNAL_THRESHOLD
    return write_mlp(tmp_path_factory.mktemp("mlp") / "mlp.onnx", LAYERS)


@pytest.fixture(scope="module")
def measured(
    mlp: Path, tmp_path_factory: pytest.TempPathFactory, module_home: Path
) -> dict[str, dict]:
    """The MLP's peak under ONNX Runtime's defaults and without prepacking, each a session
    of the artifact in a process of its own."""
    where = tmp_path_factory.mktemp("measured")
    out = {}
    for name, options in (("default", {}), ("no-prepacking", {"prepacking": False})):
        artifact = kiln.compile(mlp, where / f"{name}.kiln", engine_options=options, verify=False)
        out[name] = peak_memory(artifact.path, _feeds(WIDTH), runs=3)
    return out


@pytest.mark.parametrize(
    ("backend", "options"),
    [
        ("ort", {"prepacking": False}),
        ("ort", {"arena_extend": "same_as_requested"}),
        ("ort", {"arena_extend": "same_as_requested", "memory_pattern": False}),
        ("openvino", {"mmap": False}),
    ],
)
def test_each_memory_option_round_trips_and_changes_no_output(tmp_path, tiny, backend, options):
    feeds = _feeds(64)
    plain = kiln.compile(tiny, tmp_path / "plain.kiln", backend=backend, rounds=0)
    chosen = kiln.compile(
        tiny, tmp_path / "chosen.kiln", backend=backend, engine_options=options, rounds=0
    )
    recorded = json.loads((chosen.path / "manifest.json").read_text())
    for key, value in options.items():
        assert recorded["backend"]["options"][key] == value
        assert recorded["config"]["engine_options"][key] == value
    session = kiln.Session(chosen.path)
    assert {k: session.options[k] for k in options} == options
    want = kiln.Session(plain.path).run(None, feeds)[0]
    np.testing.assert_allclose(session.run(None, feeds)[0], want, rtol=1e-5, atol=1e-6)
    # the rebuild from the recorded config keeps them
    config = kiln.CompileConfig.from_json(recorded["config"])
    assert {k: config.engine_options[k] for k in options} == options


def test_an_artifact_without_the_memory_fields_loads_with_the_engines_defaults(tmp_path, tiny):
    artifact = kiln.compile(tiny, tmp_path / "old.kiln", rounds=0)
    manifest = json.loads((artifact.path / "manifest.json").read_text())
    for key in ("prepacking", "arena_extend"):
        del manifest["backend"]["options"][key]
    (artifact.path / "manifest.json").write_text(json.dumps(manifest))
    session = kiln.Session(artifact.path)
    assert session.options["prepacking"] is True
    assert session.options["arena_extend"] == "next_power_of_two"
    assert session.run(None, _feeds(64))[0].shape == (2, 64)


def test_an_unknown_arena_strategy_is_named(tmp_path, tiny):
    with pytest.raises(kiln.KilnError, match="unknown ORT arena_extend 'halving'"):
        kiln.compile(
            tiny, tmp_path / "a.kiln", engine_options={"arena_extend": "halving"}, rounds=0
        )


def test_without_prepacking_the_load_holds_no_packed_copy(measured):
    # Measured: 105 → 10 MiB loaded (the weights are mapped, not yet read, and no packed copy
    # is made); the runs then read every weight once, so the peak falls by the packed copy's
    # share only (105 → 91 MiB). The effect is large and fixed by the weights, not the noise.
    weights_mib = LAYERS * WIDTH * WIDTH * 4 / 2**20
    default, lean = measured["default"], measured["no-prepacking"]
    assert default["load_mib"] > 0.8 * weights_mib, measured
    assert lean["load_mib"] < 0.5 * default["load_mib"], measured
    assert lean["peak_mib"] < default["peak_mib"] - 0.05 * weights_mib, measured


def _kiln(args: list[str], cwd: Path, home: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
    env.update(KILN_HOME=str(home), COLUMNS="40")
    return subprocess.run([sys.executable, "-m", "kiln", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip


def test_optimize_under_max_memory_trades_time_for_memory(tmp_path, mlp, measured, kiln_home):
    default, lean = measured["default"]["peak_mib"], measured["no-prepacking"]["peak_mib"]
    budget = (default + lean) / 2  # under the defaults' peak, above the lean options'
    done = _kiln(["optimize", str(mlp), "-o", "fit.kiln", "--max-memory", f"{budget:.1f}MiB",
                  "--rounds", "1", "--runs", "3", "--json"], tmp_path, kiln_home)  # fmt: skip
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    memory = summary["benchmark"]["memory"]
    assert memory["fits"] and memory["budget_mib"] == pytest.approx(budget, abs=0.1)
    assert memory["peak_mib"] <= budget < memory["tried"][0]["peak_mib"]
    assert memory["tried"][0]["options"] == {}  # the engine's own options first
    assert memory["options"]["prepacking"] is False  # the option that made it fit
    for step in memory["tried"]:  # each one's memory beside what it cost in time
        assert step["peak_mib"] > 0 and step["p50_ms"] > 0 and step["latency_ratio"] > 0
    manifest = json.loads((tmp_path / "fit.kiln" / "manifest.json").read_text())
    assert manifest["backend"]["options"]["prepacking"] is False
    assert manifest["config"]["engine_options"] == memory["options"]
    assert manifest["benchmark"]["memory"] == memory
    assert any(n.startswith("--max-memory") and "× the latency" in n for n in manifest["notes"])


def test_optimize_with_a_budget_nothing_fits_writes_nothing(tmp_path, tiny, kiln_home):
    done = _kiln(["optimize", str(tiny), "-o", "none.kiln", "--max-memory", "0.5MB",
                  "--rounds", "1", "--runs", "2"], tmp_path, kiln_home)  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "nothing fits --max-memory" in lines[0], done.stderr
    assert "smallest peak reached was" in lines[0] and "Nothing was written" in lines[0]
    assert not (tmp_path / "none.kiln").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".none.kiln")]


@pytest.mark.parametrize("text", ["1.5", "lots", "0GB"])
def test_max_memory_needs_a_size(tmp_path, tiny, kiln_home, text):
    done = _kiln(["optimize", str(tiny), "-o", "x.kiln", "--max-memory", text], tmp_path,
                 kiln_home)  # fmt: skip
    assert done.returncode == 2 and "--max-memory" in done.stderr, done.stderr
    assert done.stderr.count("e.g.") <= 1, done.stderr  # one list of examples
    assert not (tmp_path / "x.kiln").exists()


def test_the_memory_options_are_searched_only_when_memory_counts():
    import onnx_ir as ir

    from kiln import zoo
    from kiln.config import CompileConfig
    from kiln.tune.space import Space, choice_of, default_params, project

    model = ir.serde.deserialize_model(zoo.build("bert-tiny"))
    for engine, key, option in (("ort", "ort.arena_extend", "arena_extend"),
                                ("openvino", "openvino.mmap", "mmap")):  # fmt: skip
        plain = Space((engine,), ("fp32",), cores=2)
        lean = Space((engine,), ("fp32",), cores=2, memory=True)
        assert key not in default_params(plain, engine) and key in default_params(lean, engine)
        assert key in project(default_params(lean, engine), lean, model, CompileConfig())
        chosen = choice_of(default_params(lean, engine), lean, model, CompileConfig())
        assert option in chosen.config.engine_options
        unchosen = choice_of(default_params(plain, engine), plain, model, CompileConfig())
        assert option not in unchosen.config.engine_options
    # weight prepacking is an option of its own now, searched for every objective
    ort = Space(("ort",), ("fp32",), cores=2)
    params = default_params(ort) | {"ort.prepacking": False}
    options = choice_of(params, ort, model, CompileConfig()).config.engine_options
    assert options["prepacking"] is False
    assert "session.disable_prepacking" not in options.get("extra", {})
