"""Ctrl-C during `kiln train --checkpoint DIR` at the worst moment — while the next checkpoint
is being written — ends with one line naming the checkpoint that survived, and that
checkpoint loads and `--resume` continues from it. The signal is sent by the process to
itself while it writes the second checkpoint, so the test does not depend on timing."""

from __future__ import annotations

import json
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
