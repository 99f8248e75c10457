"""Several `kiln tune` workers share one study — worker processes here, on the default
SQLite file and on a real PostgreSQL server (Debian's package, started for the test): no
lost trials, none measured twice, and a killed worker's trial failed and retried."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna
import pytest

from kiln.tune.storage import default_url

POSTGRES = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_postgres(*command: str) -> subprocess.CompletedProcess:
    """PostgreSQL refuses to run as root: run its tools as the `postgres` user then."""
    prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    return subprocess.run([*prefix, *command], capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def postgres_url():
    if not POSTGRES:
        if os.environ.get("CI") == "true":  # .ci/run installs it: a skip there hides a failure
            pytest.fail("PostgreSQL is not installed (apt-get install postgresql)")
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql)")
    bin_dir = POSTGRES[-1].parent
    root = Path(tempfile.mkdtemp(prefix="kiln-pg-"))
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
    data, port = root / "data", _free_port()
    made = _as_postgres(str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", "kiln")
    assert made.returncode == 0, made.stderr
    options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1"
    started = _as_postgres(str(bin_dir / "pg_ctl"), "-D", str(data), "-o", options, "-w",
                           "-l", str(root / "log"), "start")  # fmt: skip
    assert started.returncode == 0, started.stderr
    yield f"postgresql+psycopg://kiln@127.0.0.1:{port}/postgres"
    _as_postgres(str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop")
    shutil.rmtree(root, ignore_errors=True)


def tune_command(url: str, study: str, trials: int, *extra: str) -> list[str]:
    return [
        sys.executable, "-m", "kiln", "tune", "zoo:resnet-tiny", "--backend", "ort",
        "--precision", "fp32", "--storage", url, "--study", study, "--trials", str(trials),
        "--seconds-per-trial", "0.5", "--confirm-runs", "100", "--stale-after", "4",
        "--no-warm-start", "--json", *extra,
    ]  # fmt: skip


def trials_of(url: str, study: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=study, storage=url).get_trials()


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request):
    if request.param == "sqlite":
        return default_url()
    return request.getfixturevalue("postgres_url")


def test_two_workers_share_one_study_and_a_killed_workers_trial_is_retried(url):
    study = f"shared-{int(time.time() * 1000)}"
    # One worker, killed in the middle of a trial: its trial stays RUNNING, silent.
    first = subprocess.Popen(tune_command(url, study, 6, "--seconds-per-trial", "20"),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)  # fmt: skip
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            if any(t.state.name == "RUNNING" for t in trials_of(url, study)):
                break
        except KeyError:  # the study is not created yet
            pass
        time.sleep(0.05)
    else:
        pytest.fail("the first worker never started a trial")
    # At once: a trial that converges stops measuring early (a quiet machine, a tiny model),
    # and a kill between two trials would leave nothing to retry.
    os.killpg(first.pid, signal.SIGKILL)
    first.wait(timeout=30)
    killed = [t.number for t in trials_of(url, study) if t.state.name == "RUNNING"]
    assert killed, "the worker was killed between two trials"
    time.sleep(5)  # past --stale-after: the others fail and retry it
    # Two worker processes finish the study.
    done = subprocess.run(tune_command(url, study, 6, "--workers", "2"), capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    trials = trials_of(url, study)
    finished = [t for t in trials if t.state.name in ("COMPLETE", "PRUNED")]
    assert len(finished) == 6, [(t.number, t.state.name) for t in trials]
    failed = [t.number for t in trials if t.state.name == "FAIL"]
    assert failed == killed
    retried = [t for t in trials if t.system_attrs.get("failed_trial") in killed]
    assert retried and retried[0].state.name in ("COMPLETE", "PRUNED")
    measured = [t for t in finished if "duplicate_of" not in t.user_attrs]
    keys = [tuple(sorted(t.params.items())) for t in measured]
    assert len(keys) == len(set(keys)), "a configuration was measured twice"


def _pair(tmp_path: Path, index: int) -> list[str]:
    """Two `kiln tune` commands started at the same moment on a storage neither has made yet
    (the README's many-machine story, on one SQLite file); what went wrong, if anything."""
    url = f"sqlite:///{tmp_path / f'race{index}.db'}"
    command = [
        sys.executable, "-m", "kiln", "tune", "zoo:bert-tiny", "--backend", "ort", "--precision",
        "fp32", "--storage", url, "--study", "s", "--trials", "1", "--seconds-per-trial", "0.1",
        "--confirm-runs", "10", "--no-warm-start", "--json",
    ]  # fmt: skip
    workers = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True) for _ in range(2)]  # fmt: skip
    problems = []
    for worker in workers:
        out, err = worker.communicate(timeout=600)
        if worker.returncode != 0:
            problems.append(f"pair {index}: rc {worker.returncode}: {err.strip()[-300:]}")
        elif json.loads(out)["pick"]["values"] is None and "defaults" not in out:
            problems.append(f"pair {index}: no pick")
    return problems


def test_two_commands_started_together_share_one_new_study(tmp_path):
    assert _pair(tmp_path, 0) == []
    study = optuna.load_study(study_name="s", storage=f"sqlite:///{tmp_path / 'race0.db'}")
    measured = [t for t in study.trials if t.state.name == "COMPLETE"
                and "duplicate_of" not in t.user_attrs]  # fmt: skip
    keys = [tuple(sorted(t.params.items())) for t in measured]
    assert measured and len(keys) == len(set(keys)), "a configuration was measured twice"


@pytest.mark.slow
def test_twenty_pairs_of_commands_started_together_never_fail(tmp_path):
    problems = [p for i in range(20) for p in _pair(tmp_path, i)]
    assert problems == []


@pytest.mark.filterwarnings("ignore:Heartbeat of storage")  # ask() stands in for a worker
def test_a_trial_whose_worker_died_before_its_first_heartbeat_is_failed_and_retried(tmp_path):
    """The kill can land before the heartbeat thread writes once; Optuna's stale check skips
    such a trial, and every worker then waited on it for ever."""
    from kiln.tune.storage import fail_silent_trials, optuna_storage

    storage = optuna_storage(f"sqlite:///{tmp_path / 'silent.db'}", heartbeat_s=1, grace_s=2)
    study = optuna.create_study(study_name="silent", storage=storage)
    dead = study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})  # RUNNING, silent
    alive = study.ask({"x": optuna.distributions.FloatDistribution(0, 1)})
    assert fail_silent_trials(study) == []  # within the grace period: not yet
    time.sleep(2.5)  # the grace period itself is what is waited for
    storage.record_heartbeat(alive._trial_id)
    assert fail_silent_trials(study) == [dead._trial_id]
    states = {t.number: t.state.name for t in study.get_trials()}
    assert states[dead.number] == "FAIL" and states[alive.number] == "RUNNING"
    retried = [t for t in study.get_trials() if t.system_attrs.get("failed_trial") == dead.number]
    assert len(retried) == 1 and retried[0].state.name == "WAITING"
    assert fail_silent_trials(study) == []  # failed once, retried once
