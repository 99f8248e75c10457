"""kiln.train.tuning and `kiln train --tune`: trials in processes of their own, a watchdog that
stops a trial over --max-memory without harming the tuner, the loss check against the base,
the interleaved confirmation, and a tuned config that `read_config` reads back and trains.

Every end-to-end test narrows the space to one or two knobs (the rest held at the base's
values), so its trials are known: a test measures what it names in a few child runs."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
psutil = pytest.importorskip("psutil")

from cli_helpers import kiln_cli as kiln  # noqa: E402

import kiln.train.tuning.api as tuning_api  # noqa: E402
from kiln.train import TrainConfig, fit, read_config  # noqa: E402
from kiln.train.tuning import (  # noqa: E402
    LOSS_TOLERANCE,
    PREDICT_MARGIN,
    TrainSpace,
    predict_peak,
    predicted_over,
    study_name,
    training_class,
    tune,
)
from kiln.tune.library import Library  # noqa: E402
from kiln.tune.signature import hardware  # noqa: E402

MODEL, DATA, OPTIMIZER = (f"train_tune_helpers:{n}" for n in ("wide_net", "blobs", "adamw"))
KNOBS = ("precision", "micro_batch", "checkpointing", "compile", "parallel", "threads", "workers")
ONLY_BASE = {knob: [] for knob in KNOBS}  # each knob held at the base's value
BATCH = 512
STEPS = 6  # 2 warm-up + 4 measured


def run_tune(base: TrainConfig, space: dict, trials: int, **kwargs) -> dict:
    return tune(MODEL, DATA, optimizer=OPTIMIZER, base=base, global_batch=BATCH, trials=trials,
                probe_steps=STEPS, space={**ONLY_BASE, **space}, seed=0, **kwargs)  # fmt: skip


def no_children() -> bool:
    """No trial process (or rank) outlived its trial. Other tests' helpers (multiprocessing's
    resource tracker, started by spawned ranks) are not trials."""
    left = []
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):  # gone meanwhile
            left += [] if "resource_tracker" in " ".join(child.cmdline()) else [child]
    return not left


# ------------------------------------------------------------------------------ no child runs


def test_the_memory_model_fits_a_line_per_group_and_never_predicts_below_a_measure():
    group = ("fp32", "none", 1)
    points = [(group, 64, 400.0), (group, 512, 560.0)]
    assert predict_peak(points, group, 256) == pytest.approx(400 + 160 / 448 * 192)
    assert predict_peak(points, ("bf16", "none", 1), 256) is None  # another group: unknown
    assert predict_peak([(group, 64, 400.0)], group, 128) == 400.0  # more samples, ≥ the peak
    assert predict_peak([(group, 64, 400.0)], group, 32) is None
    falling = [(group, 64, 500.0), (group, 512, 450.0)]  # noise: the slope is kept ≥ 0
    assert predict_peak(falling, group, 1024) == pytest.approx(500.0)
    config = TrainConfig(micro_batch=512)
    cap = 560.0 / PREDICT_MARGIN - 1
    assert "predicted to peak at 560 MiB" in predicted_over(points, config, cap)
    assert predicted_over(points, config, 560.0 / PREDICT_MARGIN + 1) is None
    assert predicted_over(points, config, None) is None


def test_trials_stopped_by_the_memory_cap_are_named_with_figures_that_differ():
    from kiln.train.tuning import nothing_fit, over_limit

    # A peak a hair above the cap reads above it, the cap at the same precision.
    assert over_limit(415.04, 415.0) == "415.04 MiB > 415.00 MiB"
    assert over_limit(431.2, 415.0) == "431 MiB > 415 MiB"
    assert over_limit(95.3677, 95.367431640625) == "95.368 MiB > 95.367 MiB"  # 100MB
    over = {"reason": f"over the memory limit: {over_limit(415.04, 415.0)}", "peak_mib": 415.04}
    late = {"reason": "out of time: stopped where the time left for it ended", "peak_mib": 300}
    message = nothing_fit([over] * 6 + [late], 415.0, "s")
    assert message.startswith("no configuration fit --max-memory 415.00 MiB in 7 trials of "
                              "study 's': 6 were stopped over it (the leanest at 415.04 MiB), "
                              "1 ran out of time;")  # fmt: skip
    assert "raise --max-memory" in message and "more --time" in message
    assert nothing_fit([late] * 2, 415.0, "s").startswith("no trial of study 's' finished")
    assert nothing_fit([over] * 2, 415.0, "s").startswith(
        "no configuration fit --max-memory 415.00 MiB in 2 trials of study 's': 2 were "
        "stopped over it (the leanest at 415.04 MiB);"
    )


def test_different_limits_and_objectives_name_different_studies():
    specs = {"model": MODEL, "data": DATA, "loss": None, "optimizer": OPTIMIZER}
    rest = {"base": TrainConfig().to_json(), "steps": STEPS}
    names = {study_name(specs, BATCH, objective, limit, rest)
             for objective in ("samples_per_s", "time_to_loss1.5", "time_to_loss2")
             for limit in (None, 1024.0, 2048.0)}  # fmt: skip
    assert len(names) == 9
    assert study_name(specs, BATCH, "samples_per_s", 1024.0, rest) == study_name(
        specs, BATCH, "samples_per_s", 1024.0, rest
    )


def test_every_point_of_the_space_keeps_the_global_batch_and_the_base_is_its_own():
    base = TrainConfig(micro_batch=12)
    space = TrainSpace.build(base, 12, cores=4, features=["avx512_bf16"], blocks=3)
    assert space.config(space.base_params) is base
    assert "bf16" in space.choices["precision"] and "ddp-2" in space.choices["parallel"]
    names = [n for n in space.choices if n != "prefetch"]
    for values in itertools.product(*(space.choices[n] for n in names)):
        config = space.config({**dict(zip(names, values, strict=True)), "prefetch": 2})
        assert config.global_batch == 12
        assert config.threads() * config.parallel.ranks <= 4
    plain = TrainSpace.build(base, 12, cores=1, features=["avx2"], blocks=0)
    assert plain.choices["precision"] == ("fp32", "fp16")  # no bf16 kernels: not searched
    assert plain.choices["parallel"] == ("single-1",) and plain.choices["checkpointing"] == (
        "none",
    )


def test_a_short_study_first_measures_the_changes_that_pay_most_often():
    from kiln.train.tuning import seeds

    base = TrainConfig(micro_batch=12)
    space = TrainSpace.build(base, 12, cores=2, features=["amx_bf16"], blocks=3)
    configs = [space.config(p) for p in seeds(space)]
    assert [(c.precision, c.compile, c.parallel.strategy) for c in configs] == [
        ("bf16", None, "single"), ("fp32", "default", "single"), ("bf16", "default", "single"),
        ("bf16", None, "ddp")]  # fmt: skip
    assert all(c.global_batch == 12 for c in configs)
    plain = TrainSpace.build(base, 12, cores=1, features=["avx2"], blocks=3)
    assert [space.config(p).compile for p in seeds(plain)] == ["default"]  # no bf16, no ranks


def test_tuning_flags_are_refused_without_tune(monkeypatch, capsys):
    for flags, named in ((["--max-memory", "2GB"], "--max-memory"),
                         (["--trials", "3"], "--trials"),
                         (["--tune", "--epochs", "1"], "--epochs")):  # fmt: skip
        code, _out, err = kiln(monkeypatch, capsys, "train", MODEL, "--data", DATA, "--batch",
                               "8", "--steps", "1", *flags)  # fmt: skip
        assert code == 2 and err.startswith("error:") and named in err
        assert len(err.strip().splitlines()) == 1


# ------------------------------------------------------------------------------ child runs


def test_a_memory_limit_below_the_base_ends_with_a_config_that_fits(tmp_path):
    # Measure the base (micro-batch 512) and its lean variant (64 × 8) alone, then cap
    # between them: the base's trial must be stopped, the lean one must fit.
    url = f"sqlite:///{tmp_path / 'tune.db'}"
    heavy, narrow = TrainConfig(micro_batch=BATCH), {"micro_batch": [64]}
    free = run_tune(heavy, narrow, trials=1, storage=f"sqlite:///{tmp_path / 'free.db'}")
    lean = run_tune(TrainConfig(micro_batch=64, accumulation=8), {}, trials=1, storage=url)
    heavy_peak, lean_peak = free["trials"][0]["peak_mib"], lean["trials"][0]["peak_mib"]
    assert lean_peak < heavy_peak  # the helper's activations follow the micro-batch
    cap = (heavy_peak + lean_peak) / 2
    output = tmp_path / "tuned.json"
    capped = run_tune(heavy, narrow, trials=2, storage=url, max_memory_mib=cap, output=output)

    killed, fitted = capped["trials"][0], capped["trials"][1]
    assert killed["state"] == "PRUNED" and killed["reason"].startswith("over the memory limit")
    assert killed["peak_mib"] > cap and no_children()  # the tree was killed, the tuner lives
    assert fitted["state"] == "COMPLETE" and fitted["peak_mib"] <= cap
    assert capped["adopted"] and capped["verdict"].startswith("the base did not qualify: over")
    assert capped["study"] != free["study"]  # another limit, another study
    # The lean run's pick warm-started the capped study; inference studies never see it.
    assert capped["warm_start"] == [f"{MODEL} (distance 0.00)"]
    library = Library(url)
    assert len(library.records(training_class()["class"], kind="study")) == 2
    assert library.records(hardware()["class"]) == []
    config = read_config(output)
    assert (config.micro_batch, config.accumulation) == (64, 8)
    torch.manual_seed(0)
    from train_tune_helpers import adamw, blobs, wide_net

    record = fit(wide_net, blobs, optimizer=adamw, config=config, steps=2, validate=False)
    assert record["steps"] == 2 and all(v == v for v in record["loss"])  # trains, finite


def test_nothing_under_the_limit_is_one_line_and_exit_2(monkeypatch, capsys, tmp_path):
    code, out, err = kiln(monkeypatch, capsys, "train", MODEL, "--data", DATA, "--optimizer",
                          OPTIMIZER, "--batch", str(BATCH), "--tune", "--trials", "2",
                          "--steps", "4", "--max-memory", "1MB",
                          "-o", str(tmp_path / "tuned.json"))  # fmt: skip
    assert code == 2 and out == ""
    assert err.startswith("error: no configuration fit --max-memory 1 MiB in 2 trials")
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "tuned.json").exists() and no_children()


def test_a_trial_that_trains_worse_than_the_base_is_rejected_with_both_figures():
    # fp16 with a loss scale of 2^100 overflows every step: each is skipped, nothing learnt.
    base = TrainConfig(micro_batch=BATCH, loss_scale={"initial": 2.0**100})
    result = run_tune(base, {"precision": ["fp16"]}, trials=2)
    rows = {row["params"]["precision"]: row for row in result["trials"] if row["ran"]}
    worse, plain = rows["fp16"], rows["fp32"]
    assert worse["state"] == "PRUNED" and worse["reason"].startswith("trains worse")
    assert worse["loss"] > plain["loss"] * (1 + LOSS_TOLERANCE)
    assert f"{worse['loss']:.4f}" in worse["reason"] and f"{plain['loss']:.4f}" in worse["reason"]
    assert result["tolerance"] == LOSS_TOLERANCE and result["reference"]["trial"] == 0
    assert result["config"] == base.to_json() and not result["adopted"]


@pytest.mark.slow  # ~25 s of child runs on 2 cores; the default run stays under CI's budget
def test_the_pick_is_confirmed_against_the_base_in_alternating_runs(monkeypatch):
    # Whichever measured faster in its trial, the other config is picked here: a pick that
    # is not the base is always raced against it.
    monkeypatch.setattr(tuning_api, "best_trial", lambda study, _minimize: study.trials[-1])
    base = TrainConfig(micro_batch=128, accumulation=4)
    result = run_tune(base, {"micro_batch": [BATCH]}, trials=2)
    runs, speed = result["confirmation"], result["speedup"]
    assert runs["order"] == ["base", "pick", "pick", "base"]
    assert len(runs["base"]) == len(runs["pick"]) == 2
    assert all(len(steps) == STEPS - 2 for steps in runs["base"] + runs["pick"])
    assert speed["low"] <= speed["value"] <= speed["high"]
    assert result["adopted"] == (speed["low"] > 1)  # faster beyond the spread, or the base
    expected = BATCH if result["adopted"] else 128
    assert result["config"]["micro_batch"] == expected and no_children()


def test_kiln_train_tune_writes_a_config_that_kiln_train_reads_back(monkeypatch, capsys, tmp_path):
    output = tmp_path / "tuned.json"
    task = ["kiln.train.examples:byte_lm_tiny", "--data", "kiln.train.examples:stdlib_text_tiny",
            "--loss", "kiln.train.examples:lm_loss", "--batch", "8"]  # fmt: skip
    code, out, _err = kiln(monkeypatch, capsys, "train", *task, "--tune", "--trials", "1",
                           "--steps", "4", "-o", str(output), "--json")  # fmt: skip
    assert code == 0
    result = json.loads(out)
    assert [row["state"] for row in result["trials"]] == ["COMPLETE"]
    assert result["verdict"] == "the base measured best"
    assert read_config(output).global_batch == 8
    code, out, _err = kiln(monkeypatch, capsys, "train", *task, "--config", str(output),
                           "--steps", "2", "--json")  # fmt: skip
    assert code == 0 and json.loads(out)["steps"] == 2


def test_ctrl_c_ends_the_running_trial_with_kiln(tmp_path):
    # The trial tells the test (through a FIFO) that it is about to train and in which
    # session; Ctrl-C then reaches kiln only, as a terminal's does (the trial leads a session
    # of its own), and no process of that session may outlive kiln.
    fifo = tmp_path / "started"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    env = {**os.environ, "KILN_TEST_FIFO": str(fifo), "KILN_HOME": str(tmp_path / "home")}
    command = [sys.executable, "-m", "kiln", "train", MODEL, "--data",
               "train_tune_helpers:blobs_announced", "--optimizer", OPTIMIZER, "--batch",
               str(BATCH), "--tune", "--trials", "1", "--steps", "100000"]  # fmt: skip
    kiln_process = subprocess.Popen(command, cwd=Path(__file__).parent, env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    session = None
    try:
        ready, _, _ = select.select([reader], [], [], 120)
        assert ready, "no trial started"
        session = int(os.read(reader, 64).split()[0])
        kiln_process.send_signal(signal.SIGINT)
        _out, err = kiln_process.communicate(timeout=60)
        assert kiln_process.returncode == 128 + signal.SIGINT, err
        assert err.startswith("interrupted; the trial running was ended;"), err
        assert "resumes" in err and len(err.strip().splitlines()) == 1, err
        assert in_session(session) == []
    finally:
        os.close(reader)
        kiln_process.kill()
        if session is not None:  # a trial that outlived kiln (the failure) is ended here
            with contextlib.suppress(OSError):
                os.killpg(session, signal.SIGKILL)


def in_session(session: int) -> list[str]:
    """The live processes of `session`, by their command lines."""
    found = []
    for process in psutil.process_iter(["cmdline", "status"]):
        with contextlib.suppress(OSError, psutil.Error):
            if os.getsid(process.pid) == session and process.info["status"] != "zombie":
                found.append(" ".join(process.info["cmdline"] or []))
    return found
