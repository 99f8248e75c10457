"""What a new user meets first: speedups with their spread and verdict, output paths checked
before the long work, artifacts replaced only when that loses nothing, and the conventions
every verb keeps (--json, -h, --version)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import pytest
from rich.console import Console

import kiln
from kiln import zoo
from kiln.errors import KilnError
from kiln.report.terminal import format_speedup, ms, print_bench, print_optimize
from kiln.timing import (
    MIN_ROUNDS_FOR_SPREAD,
    MIN_RUNS_FOR_P99,
    p99_backing,
    round_stats,
    speedup,
    speedups,
)

MODEL = "zoo:resnet-tiny"


def kiln_cli(*args: str, cwd, ok: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "kiln", *args], cwd=cwd, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip
    assert "Traceback" not in result.stderr
    if ok:
        assert result.returncode == 0, result.stderr
    return result


def refused(*args: str, cwd, timeout: float = 300) -> str:
    """The one-line error of a command that must fail with exit code 2."""
    result = kiln_cli(*args, cwd=cwd, ok=False, timeout=timeout)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def rendered(render, data) -> str:
    console = Console(record=True, width=240)
    render(data, console)
    return console.export_text()


def rounds_of(*p50s_ms: float, runs: int = 5) -> list[list[float]]:
    """Per round, `runs` latencies (s) whose median is the given P50."""
    return [[p / 1e3 * f for f in np.linspace(0.9, 1.1, runs)] for p in p50s_ms]


# --- every speedup has its spread and verdict (one shared function) ---------------------------


@pytest.mark.parametrize(
    ("engine", "verdict"),
    [
        ((5.0, 5.2, 4.9, 5.1, 5.0), "faster"),  # every round ~2× faster
        ((9.0, 11.0, 10.5, 9.5, 10.0), "no different within noise"),
        ((20.0, 19.0, 21.0, 22.0, 20.0), "slower"),
    ],
)
def test_speedup_has_a_spread_and_a_verdict_that_every_round_agrees_with(engine, verdict):
    base = rounds_of(10.0, 10.0, 10.0, 10.0, 10.0)
    mine = rounds_of(*engine)
    result = speedup(base, mine)
    ratios = [10.0 / p for p in engine]
    assert result.spread == pytest.approx((min(ratios), max(ratios)))
    assert result.verdict == verdict
    # the ratio is the one the two printed P50s give: they can never point the other way
    assert result.value == pytest.approx(round_stats(base).p50_ms / round_stats(mine).p50_ms)
    assert result.to_json()["speedup_spread"] == pytest.approx(list(result.spread))


def test_fewer_than_three_rounds_leave_the_spread_unknown():
    base, mine = rounds_of(10.0, 10.0), rounds_of(5.0, 5.5)
    result = speedup(base, mine)
    assert MIN_ROUNDS_FOR_SPREAD == 3
    assert result.spread is None and result.verdict == "unknown"
    assert result.to_json() == {"speedup": result.value, "speedup_spread": None,
                                "verdict": "unknown"}  # fmt: skip
    assert "spread unknown" in format_speedup(result.value, None, "unknown")


def test_the_baseline_is_one_by_definition():
    samples = {"ort": rounds_of(10.0, 11.0, 9.0), "kiln": rounds_of(8.0, 9.0, 7.0)}
    compared = speedups(samples, "ort")
    assert compared["ort"].value == 1.0 and compared["ort"].verdict == "baseline"
    assert compared["kiln"].verdict == "faster"


def test_p50s_are_printed_with_the_digits_their_ratio_needs():
    assert (ms(0.1432), ms(0.1321)) == ("0.143", "0.132")  # not 0.14 → 0.13 beside 0.87×
    assert ms(0.15) == "0.150" and ms(117.4) == "117.40"


def test_optimize_shows_the_spread_the_verdict_and_what_to_try(tmp_path):
    out = kiln_cli(
        "optimize", MODEL, "-o", "r.kiln", "--rounds", "3", "--runs", "3", "--json", cwd=tmp_path
    )
    summary = json.loads(out.stdout)
    bench = summary["benchmark"]
    low, high = bench["speedup_spread"]
    assert low <= bench["speedup"] <= high
    assert bench["verdict"] in ("faster", "no different within noise", "slower")
    assert bench["speedup"] == pytest.approx(
        bench["original_ort"]["p50_ms"] / bench["artifact"]["p50_ms"]
    )
    if bench["verdict"] == "faster":
        assert summary["advice"] == ""
    else:  # the lossless artifact is not faster beyond noise: say so and name the command
        assert f"kiln optimize {MODEL} --backend auto --precision auto" in summary["advice"]
    text = rendered(print_optimize, summary)
    assert f"({low:.2f}–{high:.2f}, {bench['verdict']})" in text
    assert f"P50 {ms(bench['artifact']['p50_ms'])} ms" in text
    if summary["advice"]:
        assert "--backend auto --precision auto" in text


def test_optimize_with_too_few_rounds_says_the_spread_is_unknown(tmp_path):
    out = kiln_cli(
        "optimize", MODEL, "-o", "r.kiln", "--rounds", "1", "--runs", "3", "--json", cwd=tmp_path
    )
    summary = json.loads(out.stdout)
    assert summary["benchmark"]["speedup_spread"] is None
    assert summary["benchmark"]["verdict"] == "unknown"
    assert "--rounds 3" in summary["advice"]
    assert "spread unknown" in rendered(print_optimize, summary)


def test_optimize_says_its_p99_is_under_backed_in_the_words_bench_uses(tmp_path):
    out = kiln_cli(
        "optimize", MODEL, "-o", "r.kiln", "--rounds", "3", "--runs", "4", "--json", cwd=tmp_path
    )
    summary = json.loads(out.stdout)
    bench = summary["benchmark"]
    assert bench["p99_runs"] == 3 * 4 and bench["p99_backed"] is False
    under = f"12 runs, which is below the {MIN_RUNS_FOR_P99} MLPerf needs to back a P99"
    assert under in rendered(print_optimize, summary)
    backed = {**bench, **p99_backing(MIN_RUNS_FOR_P99)}
    assert f"{MIN_RUNS_FOR_P99} runs, which backs a P99" in rendered(print_optimize, {
        **summary, "benchmark": backed
    })  # fmt: skip


def test_a_slower_artifact_does_not_ship_without_a_word(tmp_path):
    """The table for an artifact measured slower says so, and what to try."""
    out = kiln_cli("optimize", MODEL, "-o", "r.kiln", "--rounds", "0", "--json", cwd=tmp_path)
    summary = json.loads(out.stdout)
    stats = {"p50_ms": 1.0, "p99_ms": 1.2, "jitter": 0.2}
    summary["benchmark"] = {
        "rounds": 5, "original_ort": stats, "artifact": {**stats, "p50_ms": 1.25},
        "speedup": 0.8, "speedup_spread": [0.7, 0.9], "verdict": "slower",
        "candidates": {"ort/fp32": 0.8},
    }  # fmt: skip
    from kiln.cli.console import speed_advice

    summary["advice"] = speed_advice("slower", "the artifact", "ONNX Runtime as-is", MODEL, False)
    text = rendered(print_optimize, summary)
    assert "0.80× (0.70–0.90, slower)" in text
    assert "slower than ONNX Runtime as-is" in text
    assert f"kiln optimize {MODEL} --backend auto --precision auto" in text


def test_bench_gives_every_engine_a_spread_and_a_verdict(tmp_path):
    out = kiln_cli(
        "bench", MODEL, "--against", "ort,ort-basic", "--rounds", "3", "--runs", "3",
        "--no-memory", "-o", "b.json", "--json", cwd=tmp_path,
    )  # fmt: skip
    result = json.loads(out.stdout)
    base = result["engines"]["ort"]
    assert base["verdict"] == "baseline"
    for engine in result["engines"].values():
        low, high = engine["speedup_spread"]
        assert low <= engine["speedup_vs_baseline"] <= high
        assert engine["speedup_vs_baseline"] == pytest.approx(base["p50_ms"] / engine["p50_ms"])
    kiln_row = result["engines"]["kiln"]
    assert (kiln_row["verdict"] == "faster") == (result["advice"] == "")
    assert json.loads((tmp_path / "b.json").read_text())["engines"] == result["engines"]
    text = rendered(print_bench, result)
    for name, engine in result["engines"].items():
        low, high = engine["speedup_spread"]
        assert f"{low:.2f}–{high:.2f}" in text and engine["verdict"] in text, name


# --- output paths are checked before the long work ---------------------------------------------


@pytest.fixture
def read_only_dir(tmp_path) -> Path:
    """A directory this process cannot create files in. Root ignores permissions, so there
    it is /sys, which refuses new files to everyone."""
    where = tmp_path / "ro"
    where.mkdir()
    where.chmod(0o555)
    for candidate in (where, Path("/sys")):
        try:
            tempfile.TemporaryFile(dir=candidate).close()
        except OSError:
            yield candidate
            break
    else:
        pytest.skip("no directory here refuses new files")
    where.chmod(0o755)


BAD_OUTPUTS = {
    "missing directory": lambda d, ro: d / "no" / "such" / "out",
    "a directory": lambda d, ro: d,
    "read-only directory": lambda d, ro: ro / "out",
}


@pytest.mark.parametrize("bad", list(BAD_OUTPUTS))
@pytest.mark.parametrize(
    "verb",
    [
        # rounds no benchmark could finish in time: a late check would be a timeout
        ("bench", MODEL, "--rounds", "100000", "--runs", "100", "-o", "{out}"),
        ("zoo", "export", "resnet-tiny", "-o", "{out}"),
        ("run", "{artifact}", "--inputs", "in.npz", "-o", "{out}"),
    ],
    ids=["bench", "zoo-export", "run"],
)
def test_a_bad_output_file_fails_before_any_work(verb, bad, tmp_path, read_only_dir):
    out = BAD_OUTPUTS[bad](tmp_path, read_only_dir)
    args = [a.format(out=out, artifact=tmp_path / "missing.kiln") for a in verb]
    before = sorted(tmp_path.rglob("*"))
    line = refused(*args, cwd=tmp_path, timeout=120)
    assert f"-o {out}:" in line and "choose another -o path" in line
    assert sorted(tmp_path.rglob("*")) == before


def test_optimize_into_a_read_only_directory_fails_before_compiling(tmp_path, read_only_dir):
    # gpt2 (124M parameters) takes minutes to compile here: a late check would time out.
    line = refused("optimize", "zoo:gpt2", "-o", str(read_only_dir / "g.kiln"), cwd=tmp_path,
                   timeout=60)  # fmt: skip
    assert f"{read_only_dir / 'g.kiln'}: cannot write in {read_only_dir}" in line
    missing = tmp_path / "no" / "g.kiln"
    line = refused("optimize", "zoo:gpt2", "-o", str(missing), cwd=tmp_path, timeout=60)
    assert f"the directory {missing.parent} does not exist" in line


# --- an artifact is replaced only when that loses nothing ----------------------------------------


def test_an_artifact_is_replaced_and_says_so(tmp_path):
    first = json.loads(kiln_cli("optimize", MODEL, "-o", "r.kiln", "--rounds", "0", "--json",
                                cwd=tmp_path).stdout)  # fmt: skip
    assert first["replaced"] is False
    second = kiln_cli("optimize", MODEL, "-o", "r.kiln", "--rounds", "0", cwd=tmp_path).stdout
    assert "replaced the artifact at" in second
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.kiln"]  # no temporary left


def test_the_model_being_compiled_is_never_the_output_even_forced(tmp_path):
    model = tmp_path / "self.onnx"
    onnx.save(zoo.build("resnet-tiny"), model)
    before = model.read_bytes()
    for target in (model, tmp_path):  # the model itself, or a directory holding it
        line = refused("optimize", str(model), "-o", str(target), "--force", "--rounds", "0",
                       cwd=tmp_path)  # fmt: skip
        assert "the model being compiled" in line
    assert model.read_bytes() == before


def test_forcing_over_a_directory_says_a_directory_was_replaced(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "important.txt").write_text("keep\n")
    done = kiln_cli("optimize", MODEL, "-o", "mine", "--force", "--rounds", "0", cwd=tmp_path)
    assert "replaced the directory at mine" in done.stdout


def test_an_artifact_holding_the_users_files_is_refused_unless_forced(tmp_path):
    kiln_cli("optimize", MODEL, "-o", "r.kiln", "--rounds", "0", cwd=tmp_path)
    (tmp_path / "r.kiln" / "notes.txt").write_text("mine\n")
    line = refused("optimize", MODEL, "-o", "r.kiln", "--rounds", "0", cwd=tmp_path)
    assert "notes.txt" in line and "--force" in line
    assert (tmp_path / "r.kiln" / "notes.txt").read_text() == "mine\n"
    out = kiln_cli("optimize", MODEL, "-o", "r.kiln", "--rounds", "0", "--force", "--json",
                   cwd=tmp_path)  # fmt: skip
    assert json.loads(out.stdout)["replaced"] is True
    assert not (tmp_path / "r.kiln" / "notes.txt").exists()


def test_a_non_artifact_is_refused_unless_forced(tmp_path):
    (tmp_path / "r.kiln").mkdir()
    (tmp_path / "r.kiln" / "data.csv").write_text("1,2\n")
    line = refused("optimize", MODEL, "-o", "r.kiln", "--rounds", "0", cwd=tmp_path)
    assert "is not a Kiln artifact" in line and "--force" in line
    assert (tmp_path / "r.kiln" / "data.csv").exists()
    (tmp_path / "f.kiln").write_text("a file\n")
    refused("optimize", MODEL, "-o", "f.kiln", "--rounds", "0", cwd=tmp_path)
    kiln_cli("optimize", MODEL, "-o", "f.kiln", "--rounds", "0", "--force", cwd=tmp_path)
    assert (tmp_path / "f.kiln" / "manifest.json").is_file()


def test_compile_api_refuses_the_users_files_unless_forced(tmp_path):
    destination = tmp_path / "r.kiln"
    kiln.compile(MODEL, destination, rounds=0)
    kiln.compile(MODEL, destination, rounds=0)  # its own artifact: replaced
    (destination / "notes.txt").write_text("mine\n")
    with pytest.raises(KilnError, match="notes.txt"):
        kiln.compile(MODEL, destination, rounds=0)
    assert (destination / "notes.txt").exists()
    artifact = kiln.compile(MODEL, destination, force=True, rounds=0)
    assert sorted(p.name for p in artifact.path.iterdir()) == sorted(
        ["manifest.json", "model.onnx", "provenance.json"]
    )


# --- every verb takes --json, -h; kiln --version ------------------------------------------------


def test_run_zoo_export_and_show_pipeline_take_json(tmp_path):
    exported = json.loads(kiln_cli("zoo", "export", "resnet-tiny", "-o", "m.onnx", "--json",
                                   cwd=tmp_path).stdout)  # fmt: skip
    assert exported["output"] == "m.onnx" and exported["external_data"] is None
    assert exported["bytes"] == (tmp_path / "m.onnx").stat().st_size
    onnx.checker.check_model(str(tmp_path / "m.onnx"))
    kiln_cli("optimize", "m.onnx", "-o", "m.kiln", "--rounds", "0", cwd=tmp_path)
    names = [i.name for i in zoo.build("resnet-tiny").graph.input]
    np.savez(tmp_path / "in.npz", **{names[0]: np.zeros((1, 3, 32, 32), np.float32)})
    ran = json.loads(kiln_cli("run", "m.kiln", "--inputs", "in.npz", "-o", "out.npz", "--json",
                              cwd=tmp_path).stdout)  # fmt: skip
    with np.load(tmp_path / "out.npz") as got:
        assert [o["name"] for o in ran["outputs"]] == list(got.files)
        assert [o["shape"] for o in ran["outputs"]] == [list(got[n].shape) for n in got.files]
    said = kiln_cli("run", "m.kiln", "--inputs", "in.npz", "-o", "out.npz", cwd=tmp_path).stdout
    assert said.strip() == "wrote 1 output to out.npz", said  # resnet-tiny has one
    steps = json.loads(kiln_cli("optimize", "--show-pipeline", "--json", cwd=tmp_path).stdout)
    assert [s["index"] for s in steps] == list(range(1, len(steps) + 1))
    text = kiln_cli("optimize", "--show-pipeline", cwd=tmp_path).stdout
    assert all(s["name"] in text for s in steps)


def _verbs() -> list[list[str]]:
    from typer.main import get_command

    from kiln.cli import app

    group = get_command(app)
    verbs = []
    for name, command in group.commands.items():
        subcommands = getattr(command, "commands", None)
        verbs += [[name, sub] for sub in subcommands] if subcommands else [[name]]
    return verbs


@pytest.mark.parametrize("verb", _verbs(), ids=" ".join)
def test_every_verb_takes_h_and_json(verb, tmp_path):
    short = kiln_cli(*verb, "-h", cwd=tmp_path).stdout
    assert short == kiln_cli(*verb, "--help", cwd=tmp_path).stdout
    assert "--json" in short


def test_version(tmp_path):
    assert kiln_cli("--version", cwd=tmp_path).stdout.strip() == f"kiln {kiln.__version__}"


def test_zoo_info_compares_like_with_like(tmp_path):
    info = json.loads(kiln_cli("zoo", "info", "resnet50", "--json", cwd=tmp_path).stdout)
    # published figures count 2 × MACs; so does the deviation, not the all-op total
    assert info["deviation"] == pytest.approx(info["mac_gflops"] / info["published_gflops"] - 1)
    assert abs(info["deviation"]) < 0.005 and info["gflops"] > info["mac_gflops"]
    assert "2×MAC" in info["deviation_basis"]


if os.name != "posix":  # pragma: no cover
    pytestmark = pytest.mark.skip("POSIX permissions")
