"""The command line's happy paths, run as a user would: a real `kiln` process each time."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import numpy as np
import onnx
import pytest
from rich.console import Console

from kiln import zoo
from kiln.report.terminal import ms, print_bench, print_doctor, print_optimize, print_zoo_info


def rendered(render, data) -> str:
    """What a verb's table shows for `data` (its --json output), on a wide terminal."""
    console = Console(record=True, width=200)
    render(data, console)
    return console.export_text()


def kiln(*args: str, cwd) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "kiln", *args], cwd=cwd, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    return result


@pytest.fixture(scope="module")
def artifact(tmp_path_factory):
    """bert-tiny optimized once, through the CLI, with --json."""
    where = tmp_path_factory.mktemp("cli")
    out = kiln("optimize", "zoo:bert-tiny", "-o", "bert.kiln", "--rounds", "2", "--json", cwd=where)
    return where, json.loads(out.stdout)


def test_optimize_json_reports_passes_verification_and_timing(artifact):
    where, summary = artifact
    assert (where / "bert.kiln" / "manifest.json").is_file()
    assert summary["verification"]["ok"]
    assert {p["name"] for p in summary["passes"] if p["rewrites"]} >= {"fuse-attention"}
    assert summary["nodes"]["after"] < summary["nodes"]["before"]
    bench = summary["benchmark"]
    assert bench["speedup"] > 0 and bench["artifact"]["p99_ms"] >= bench["artifact"]["p50_ms"]


def test_optimize_table_shows_what_the_json_says(artifact):
    _, summary = artifact
    text = rendered(print_optimize, summary)
    for name in {p["name"] for p in summary["passes"] if p["rewrites"]}:
        assert f"pass {name}" in text
    assert f"{summary['nodes']['before']} → {summary['nodes']['after']}" in text
    assert "passed" in text and f"{summary['benchmark']['speedup']:.2f}×" in text


def test_run_writes_the_outputs_onnxruntime_gives(artifact, tmp_path):
    where, _ = artifact
    rng = np.random.default_rng(0)
    feeds = {
        "input_ids": rng.integers(0, 1000, (2, 16)),
        "attention_mask": np.ones((2, 16), np.int64),
        "token_type_ids": np.zeros((2, 16), np.int64),
    }
    np.savez(tmp_path / "in.npz", **feeds)
    kiln("run", str(where / "bert.kiln"), "--inputs", "in.npz", "-o", "out.npz", cwd=tmp_path)
    import onnxruntime as ort

    reference = ort.InferenceSession(
        zoo.build("bert-tiny").SerializeToString(), providers=["CPUExecutionProvider"]
    ).run(None, feeds)
    with np.load(tmp_path / "out.npz") as got:
        np.testing.assert_allclose(got["last_hidden_state"], reference[0], atol=1e-4)
        np.testing.assert_allclose(got["pooler_output"], reference[1], atol=1e-4)


def test_show_pipeline_lists_every_pass(tmp_path):
    out = kiln("optimize", "--show-pipeline", cwd=tmp_path).stdout
    for name in ("simplify", "canonical-mask", "fuse-causal-attention", "prune-rows", "cleanup"):
        assert name in out


def test_zoo_list_info_export(tmp_path):
    listed = json.loads(kiln("zoo", "list", "--json", cwd=tmp_path).stdout)
    assert {e["name"] for e in listed} == set(zoo.names())
    info = json.loads(kiln("zoo", "info", "resnet-tiny", "--json", cwd=tmp_path).stdout)
    assert info["gflops"] > 0 and info["parameters"] > 0
    kiln("zoo", "export", "gpt2-tiny", "-o", "g.onnx", cwd=tmp_path)
    onnx.checker.check_model(str(tmp_path / "g.onnx"))
    table = kiln("zoo", "list", cwd=tmp_path).stdout
    assert all(name in table for name in zoo.names())
    assert f"{info['gflops']:.3f}" in rendered(print_zoo_info, info)


def test_a_table_piped_without_columns_shows_its_cells_whole(tmp_path):
    # Piped, as a log or a grep reads it, with no COLUMNS (the environment given explicitly:
    # this process's own may hold a COLUMNS that a line-editing library set for its terminal).
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    table = subprocess.run([sys.executable, "-m", "kiln", "zoo", "list"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert all(zoo.entry(name).description in table for name in zoo.names()), table


def test_bench_compares_engines_and_writes_json(tmp_path):
    out = kiln(
        "bench", "zoo:resnet-tiny", "--against", "ort,ort-basic", "--rounds", "2", "--runs", "3",
        "-o", "bench.json", "--json", cwd=tmp_path,
    )  # fmt: skip
    result = json.loads(out.stdout)
    assert set(result["engines"]) == {"ort", "ort-basic", "kiln"}
    assert result["engines"]["ort"]["speedup_vs_baseline"] == 1.0
    assert json.loads((tmp_path / "bench.json").read_text())["model"] == "zoo:resnet-tiny"
    rows = {
        cells[1].strip(): cells[2].strip()
        for cells in (line.split("│") for line in rendered(print_bench, result).splitlines())
        if len(cells) > 2
    }
    for name, engine in result["engines"].items():
        assert rows[name] == ms(engine["p50_ms"])
        # the P50 is the median of the rounds' P50s, each round's given for pairing engines
        assert engine["p50_ms"] == pytest.approx(statistics.median(engine["round_p50_ms"]))
        assert len(engine["round_p50_ms"]) == result["rounds"]
    # An 80-column terminal (or a log) gets an engine a column: every figure shows whole.
    narrow = Console(record=True, width=80)
    print_bench(result, narrow)
    lines = narrow.export_text().splitlines()
    p50 = next(line for line in lines if line.startswith("│ P50 ms"))
    assert all(ms(e["p50_ms"]) in p50 for e in result["engines"].values()), p50
    assert max(len(line) for line in lines) <= 80


def test_doctor_names_engines_and_cpu(tmp_path):
    info = json.loads(kiln("doctor", "--json", cwd=tmp_path).stdout)
    assert info["engines"]["ort"]["engine"] == "onnxruntime"
    assert info["cpu"]["logical_cores"] >= 1 and info["hardware_fingerprint"]
    text = rendered(print_doctor, info)
    assert info["cpu"]["model"] in text
    assert all(f"engine {name}" in text for name in info["engines"])


def test_help_lists_every_verb_without_loading_their_dependencies(tmp_path):
    verbs = ("zoo", "optimize", "run", "bench", "doctor", "serve", "profile", "tune",
             "strategies", "compare")  # fmt: skip
    shown = kiln("--help", cwd=tmp_path).stdout
    assert all(verb in shown for verb in verbs)
    # The verbs import the compiler, engines, servers and report templates when they run.
    probe = "import sys, kiln.cli; print(' '.join(sorted(sys.modules)))"
    loaded = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    ).stdout.split()
    heavy = {"kiln.compiler", "kiln.runtime", "onnx", "onnxruntime", "uvicorn", "plotly"}
    assert not heavy & set(loaded)


def test_backend_auto_times_every_engine_and_records_the_choice(tmp_path):
    pytest.importorskip("openvino")
    out = kiln(
        "optimize", "zoo:resnet-tiny", "-o", "r.kiln", "--backend", "auto",
        "--rounds", "2", "--runs", "3", "--json", cwd=tmp_path,
    )  # fmt: skip
    summary = json.loads(out.stdout)
    bench = summary["benchmark"]
    assert set(bench["candidates"]) == {"ort/fp32", "openvino/fp32"}
    assert bench["choice"] == summary["backend"]["name"] + "/fp32"
    assert bench["speedup"] == max(bench["candidates"].values())


def test_precision_auto_builds_every_precision_and_keeps_one_that_verifies(tmp_path):
    pytest.importorskip("openvino")
    out = kiln(
        "optimize", "zoo:resnet-tiny", "-o", "r.kiln", "--backend", "auto", "--precision", "auto",
        "--rounds", "2", "--runs", "3", "--json", cwd=tmp_path,
    )  # fmt: skip
    summary = json.loads(out.stdout)
    bench = summary["benchmark"]
    tried = set(bench["candidates"]) | set(bench["refused"])
    assert {"ort/fp32", "openvino/fp32", "ort/int8"} <= tried
    assert summary["verification"]["ok"]
    assert bench["choice"] in bench["candidates"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["bench", "zoo:resnet-tiny", "--runs", "0"], "--runs 0: use at least 1."),
        (["bench", "zoo:resnet-tiny", "--batch", "-1"], "--batch -1: use at least 1."),
        (["bench", "zoo:resnet-tiny", "--rounds", "0"], "--rounds 0: use at least 1."),
        (["optimize", "zoo:resnet-tiny", "--rounds", "-1"], "--rounds -1: use at least 0."),
        (["optimize", "zoo:resnet-tiny", "--runs", "-3"], "--runs -3: use at least 1."),
        (["profile", "zoo:resnet-tiny", "--batch", "0"], "--batch 0: use at least 1."),
        (
            ["serve", "zoo:resnet-tiny", "--feedback-interval", "5"],
            "--feedback-interval sets the feedback loop: add --feedback, or drop it.",
        ),
        (
            ["serve", "zoo:resnet-tiny", "--min-gain", "0.2"],
            "--min-gain sets the feedback loop: add --feedback, or drop it.",
        ),
    ],
)
def test_counts_below_their_minimum_are_refused_before_any_work(args, message, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "kiln", *args], cwd=tmp_path, capture_output=True, text=True
    )
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {message}"
    assert list(tmp_path.iterdir()) == []


def test_bench_takes_the_batch_from_its_inputs(tmp_path):
    import onnx_ir as ir

    from kiln.ir.inputs import synthesize

    model = ir.serde.deserialize_model(zoo.build("resnet-tiny"))
    np.savez(tmp_path / "b3.npz", **synthesize(model, {"batch": 3}))
    out = kiln("bench", "zoo:resnet-tiny", "--inputs", "b3.npz", "--rounds", "1", "--runs", "2",
               "--no-memory", "--json", cwd=tmp_path)  # fmt: skip
    result = json.loads(out.stdout)
    assert result["batch"] == 3
    for engine in result["engines"].values():  # samples per second count all three samples
        assert engine["throughput"] == pytest.approx(3e3 / engine["mean_ms"])


def test_long_work_shows_progress_lines_when_stderr_is_not_a_terminal(tmp_path):
    # A batch job or `| tee` sees plain lines (the live bar is for terminals): here every
    # description, with the throttle off.
    out = tmp_path / "bert.kiln"
    done = subprocess.run(
        [sys.executable, "-c", "import kiln.cli.console as c; c.LogProgress.LOG_EVERY_S = 0.0; "
         "import sys; from kiln.cli import main; sys.argv = ['kiln', 'optimize', "
         f"'zoo:bert-tiny', '-o', {str(out)!r}, '--rounds', '0']; main()"],
        capture_output=True, text=True, timeout=300,
        env={k: v for k, v in os.environ.items() if k != "KILN_PROGRESS"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.startswith("[")]
    assert any("loading zoo:bert-tiny" in line for line in lines), done.stderr
    assert any("writing the artifact" in line for line in lines), done.stderr


def test_a_process_a_library_forks_ends_quietly_on_ctrl_c():
    # OpenVINO's telemetry sender is a forked child holding Kiln's signal handler: Ctrl-C
    # (sent to the whole group) must end it without a traceback, as the default would.
    code = (
        "import os, signal, time\n"
        "import kiln.cli as c\n"
        "signal.signal(signal.SIGINT, c._stop)\n"
        "ready, told = os.pipe()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os.write(told, b'1'); time.sleep(30); os._exit(0)\n"
        "os.read(ready, 1)\n"  # the child runs Python: a signal now reaches its handler
        "os.kill(pid, signal.SIGINT)\n"
        "print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "130" and "Traceback" not in done.stderr, done.stderr


def test_a_log_line_held_back_by_the_throttle_is_written_when_its_turn_comes(capsys, monkeypatch):
    # Off a terminal: the first step is announced at once, and a step that starts within the
    # throttle is written when its turn comes rather than never (a long step is not silent).
    from kiln.cli.console import LogProgress

    monkeypatch.setattr(LogProgress, "LOG_EVERY_S", 0.2)
    with LogProgress() as bar:
        bar.add_task("recording the reference")
        assert "recording the reference" in capsys.readouterr().err
        bar.update(0, description="compiling det")
        bar.update(0, description="compiling rec")  # the newest wins
        bar._timer.join(timeout=5)
        err = capsys.readouterr().err
    assert "compiling rec" in err and "compiling det" not in err
