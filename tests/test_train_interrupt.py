"""Ctrl-C during `kiln train --checkpoint DIR` at the worst moment — while the next checkpoint
is being written — ends with one line naming the checkpoint that survived, and that
checkpoint loads and `--resume` continues from it. The signal is sent by the process to
itself while it writes the second checkpoint, so the test does not depend on timing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

TASK = ["train", "train_tune_helpers:wide_net", "--data", "train_tune_helpers:blobs",
        "--batch", "16", "--checkpoint-every", "2"]  # fmt: skip

# `kiln train ... --steps 50`, with SIGINT raised inside the second checkpoint's save: after
# its shards are written, before its marker (what makes a checkpoint whole) is.
SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    import kiln.train.checkpoint as checkpoint
    real = checkpoint._save_extra
    calls = []

    def save_extra(*args, **kwargs):
        calls.append(1)
        real(*args, **kwargs)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGINT)

    checkpoint._save_extra = save_extra
    sys.argv = ["kiln", *sys.argv[1:]]
    from kiln.cli import main
    main()
    """
)


def _kiln(*args: str, script: str | None = None) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-c", script] if script else [sys.executable, "-m", "kiln"]
    # From tests/, which the user's module (train_tune_helpers) is imported from.
    return subprocess.run([*command, *args], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).parent)  # fmt: skip


def test_ctrl_c_while_checkpointing_keeps_the_last_whole_checkpoint_loadable(tmp_path):
    from train_tune_helpers import wide_net

    from kiln.train import checkpoint

    directory = tmp_path / "ckpt"
    stopped = _kiln(*TASK, "--steps", "50", "--checkpoint", str(directory), script=SCRIPT)
    assert stopped.returncode == 128 + signal.SIGINT, stopped.stderr
    lines = stopped.stderr.strip().splitlines()
    assert len(lines) == 1, stopped.stderr
    assert lines[0].startswith("interrupted; the newest checkpoint, ")
    assert "step-00000002" in lines[0] and "--resume" in lines[0]

    found = checkpoint.latest(directory)
    assert found is not None and found.name == "step-00000002"  # the partial step 4 is not
    model = wide_net()
    optimizer = torch.optim.AdamW(model.parameters())
    step, _ = checkpoint.load(found, model, optimizer)
    assert step == 2 and optimizer.state  # the optimizer's moments came back too

    record = tmp_path / "rest.json"
    resumed = _kiln(*TASK, "--steps", "4", "--checkpoint", str(directory), "--resume",
                    "-o", str(record))  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr
    assert json.loads(record.read_text())["steps_this_run"] == 2


# The user's module, on one rank or several: a Ctrl-C (SIGINT to the whole foreground process group,
# as a terminal sends it) raised by rank 0 inside its second checkpoint's save, after the
# shards and before the marker. Ranks import it to build the model, so the patch is theirs.
RANKS_MODULE = textwrap.dedent(
    """
    import os, signal
    import kiln.train.checkpoint as checkpoint
    from train_tune_helpers import blobs, wide_net
    real = checkpoint._save_extra
    calls = []

    def save_extra(*args, **kwargs):
        calls.append(1)
        real(*args, **kwargs)
        if len(calls) == 2:
            os.killpg(os.getpgrp(), signal.SIGINT)

    checkpoint._save_extra = save_extra


    def net():
        return wide_net()


    def data():
        return blobs()
    """
)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["single", "ddp", "fsdp2", "pipeline"])
def test_ctrl_c_on_any_strategy_names_the_whole_checkpoint_and_leaves_no_partial(
    strategy: str, tmp_path: Path
) -> None:
    (tmp_path / "interrupting.py").write_text(RANKS_MODULE)
    directory = tmp_path / "ckpt"
    # The ranks import the helper's module from tests/, beside the user's module here.
    tests = os.pathsep.join(
        filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")])
    )
    ranks = "1" if strategy == "single" else "2"
    stopped = subprocess.run(
        [sys.executable, "-m", "kiln", "train", "interrupting:net", "--data", "interrupting:data",
         "--batch", "16", "--checkpoint-every", "2", "--steps", "50", "--nproc", ranks,
         "--strategy", strategy, "--checkpoint", str(directory)],
        capture_output=True, text=True, timeout=280, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": tests}, start_new_session=True,
    )  # fmt: skip
    assert stopped.returncode == 128 + signal.SIGINT, stopped.stderr
    # Off a terminal kiln train also writes progress lines; apart from those, one line.
    lines = [line for line in stopped.stderr.strip().splitlines()
             if not line.startswith("training: step")]  # fmt: skip
    assert len(lines) == 1, stopped.stderr
    assert lines[0].startswith("interrupted; the newest checkpoint, ")
    assert "step-00000002" in lines[0] and "--resume" in lines[0]
    assert sorted(p.name for p in directory.iterdir()) == ["step-00000002"]
