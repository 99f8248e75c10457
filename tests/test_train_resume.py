"""What a long `kiln train` run relies on. Resuming from a checkpoint is the uninterrupted
run, step for step, for a model with dropout on shuffled data whose samples draw from numpy
and Python's `random` (the checkpoint keeps every rank's random generators and the data
position), and only under the config the checkpoint was made with; checkpoint storage is
checked before step 1 and a full disk is named; the record reproduces the run; a log (stderr
not a terminal) gets plain progress lines."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from kiln.errors import KilnError  # noqa: E402
from kiln.train import TrainConfig, fit  # noqa: E402
from kiln.train.checkpoint import latest  # noqa: E402


def dropout_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 3))


class Noisy(torch.utils.data.Dataset):
    """Samples augmented with numpy and Python random draws, as users' datasets do."""

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(40, 8, generator=generator)
        self.y = torch.randint(0, 3, (40,), generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        noise = torch.from_numpy(np.random.normal(0, 0.1, 8).astype(np.float32))
        return self.x[index] * random.uniform(0.9, 1.1) + noise, self.y[index]


def noisy_data() -> Noisy:
    np.random.seed(2)  # the user's own seeding, before training starts
    random.seed(3)
    return Noisy()


def _resumed_at_10(config: TrainConfig, tmp_path) -> tuple[list[float], list[float]]:
    """The losses of steps 11-20: of one uninterrupted run, and of a run resumed from the
    checkpoint the first one wrote at step 10 (40 samples, batch 8: mid-way through epoch 3)."""
    whole = fit(dropout_net, noisy_data, config=config, steps=20, checkpoint=tmp_path / "a",
                checkpoint_every=10, validate=False)  # fmt: skip
    stopped = tmp_path / "b" / "step-00000010"
    shutil.copytree(tmp_path / "a" / "step-00000010", stopped)
    rest = fit(dropout_net, noisy_data, config=config, steps=20, checkpoint=tmp_path / "b",
               resume=True, validate=False)  # fmt: skip
    assert latest(tmp_path / "b").name == "step-00000020" and rest["steps_this_run"] == 10
    return whole["loss"][10:], rest["loss"]


def test_a_dropout_model_resumed_at_step_10_is_the_uninterrupted_run(tmp_path):
    whole, resumed = _resumed_at_10(TrainConfig(micro_batch=4, accumulation=2), tmp_path)
    assert resumed == whole


@pytest.mark.timeout(240)
def test_two_ranks_resumed_at_step_10_are_the_uninterrupted_run(tmp_path):
    parallel = {"strategy": "ddp", "ranks": 2, "threads_per_rank": 1}
    whole, resumed = _resumed_at_10(TrainConfig(micro_batch=4, parallel=parallel), tmp_path)
    assert resumed == whole


def test_a_resume_under_a_config_that_changes_the_data_or_the_math_is_refused(tmp_path):
    config = TrainConfig(micro_batch=4)
    fit(dropout_net, noisy_data, config=config, steps=2, checkpoint=tmp_path, validate=False)
    # How the same global batch is spread may change: 2 micro-batches of 2 make one of 4.
    spread = config.replace(micro_batch=2, accumulation=2)
    again = fit(dropout_net, noisy_data, config=spread, steps=4, checkpoint=tmp_path,
                resume=True, validate=False)  # fmt: skip
    assert again["steps_this_run"] == 2
    changed = config.replace(micro_batch=8, precision="bf16")
    with pytest.raises(KilnError, match="global_batch 4 → 8; precision fp32 → bf16") as refused:
        fit(dropout_net, noisy_data, config=changed, steps=6, checkpoint=tmp_path, resume=True)
    assert "--allow-config-change" in str(refused.value)
    allowed = fit(dropout_net, noisy_data, config=changed, steps=6, checkpoint=tmp_path,
                  resume=True, allow_config_change=True, validate=False)  # fmt: skip
    assert allowed["steps"] == 6 and allowed["steps_this_run"] == 2


def _kiln(*args: str) -> subprocess.CompletedProcess[str]:
    # From tests/, which this module (the user's model and data) is imported from.
    return subprocess.run([sys.executable, "-m", "kiln", "train", "test_train_resume:dropout_net",
                           "--data", "test_train_resume:noisy_data", "--batch", "4", *args],
                          capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parent)  # fmt: skip


def half_cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(output, target) / 2


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.5)


def test_the_record_reproduces_the_run_with_its_loss_and_optimizer(tmp_path):
    first, second = tmp_path / "first.json", tmp_path / "second.json"
    made = _kiln("--steps", "2", "--loss", "test_train_resume:half_cross_entropy",
                 "--optimizer", "test_train_resume:sgd", "-o", str(first))  # fmt: skip
    assert made.returncode == 0, made.stderr
    record = json.loads(first.read_text())
    assert record["loss_function"] == "test_train_resume:half_cross_entropy"
    assert record["optimizer"] == "test_train_resume:sgd"
    assert record["versions"]["torch"] == torch.__version__ and record["host"]["name"]
    again = _kiln("--steps", "2", "--config", str(first), "-o", str(second))
    assert again.returncode == 0, again.stderr
    # The same loss and optimizer, not cross-entropy and AdamW: the same numbers.
    assert json.loads(second.read_text())["loss"] == record["loss"]


def test_a_log_gets_a_plain_progress_line_every_n_seconds():
    # stderr is a pipe here, as in a batch job or under `| tee`: no live bar, plain lines.
    done = _kiln("--steps", "2", "--progress-every", "0")
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    assert [line.split(",")[0] for line in lines] == ["training: step 1 of 2",
                                                      "training: step 2 of 2"]  # fmt: skip
    assert "loss" in lines[-1] and "samples/s" in lines[-1]


def test_nothing_to_train_and_a_negative_count_are_one_line_and_rc_2(tmp_path):
    fit(dropout_net, noisy_data, config=TrainConfig(micro_batch=4), steps=3, checkpoint=tmp_path,
        validate=False)  # fmt: skip
    for bound in ({"epochs": 0}, {"seconds": -1.0}):  # the Python API refuses them too
        with pytest.raises(KilnError, match="give a length above 0"):
            fit(dropout_net, noisy_data, config=TrainConfig(micro_batch=4), **bound)
    for args, message in [
        (("--steps", "-3"), "--steps -3: use at least 1."),
        (("--steps", "3", "--checkpoint", str(tmp_path), "--resume"),
         "is at step 3, already at --steps 3: nothing to train; give --steps above 3."),
    ]:  # fmt: skip
        done = _kiln(*args)
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip().endswith(message) and len(done.stderr.splitlines()) == 1


# ------------------------------------------------------------------ checkpoint storage


@pytest.fixture
def tmpfs(tmp_path):
    """A tmpfs mounted with the given options (mount needs root, as CI has); the test skips
    where mounting is not permitted."""
    mounted = []

    def mount(options: str) -> Path:
        target = tmp_path / f"mount{len(mounted)}"
        target.mkdir()
        try:
            done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)],
                                  capture_output=True, text=True, timeout=30)  # fmt: skip
        except FileNotFoundError:
            pytest.skip("no mount command here")
        if done.returncode:
            pytest.skip(f"mount not permitted here: {done.stderr.strip()}")
        mounted.append(target)
        return target

    yield mount
    for target in mounted:
        subprocess.run(["umount", str(target)], timeout=30)


def test_a_read_only_checkpoint_directory_is_refused_before_step_1(tmpfs):
    steps = []
    with pytest.raises(KilnError, match="cannot write checkpoints there \\(Read-only file system"):
        fit(dropout_net, noisy_data, config=TrainConfig(micro_batch=4), steps=2,
            checkpoint=tmpfs("ro,size=64k") / "ckpt", progress=steps.append)  # fmt: skip
    assert steps == []  # no training was spent before the refusal


def test_a_full_disk_says_so_and_leaves_no_partial_checkpoint(tmpfs):
    def wide() -> nn.Module:  # weights and AdamW's moments: ~37 kB, over the disk's 16
        return nn.Sequential(nn.Linear(8, 256), nn.Dropout(0.5), nn.Linear(256, 3))

    directory = tmpfs("size=16k") / "ckpt"
    with pytest.raises(KilnError, match="no space left on device; the checkpoint of step 2"):
        fit(wide, noisy_data, config=TrainConfig(micro_batch=4), steps=2, checkpoint=directory,
            validate=False)  # fmt: skip
    assert list(directory.iterdir()) == []


class _Stop(BaseException):
    """A stop signal as the CLI raises it (a BaseException that is no Exception)."""


def test_a_stop_inside_the_checkpoint_writer_is_a_stop_and_leaves_nothing_partial(
    tmp_path, monkeypatch
) -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    from kiln.train import checkpoint

    def interrupted(*args, **kwargs):  # DCP wraps what its writer raised, a stop included
        raise CheckpointException("write failed", {0: (_Stop(), None)})

    monkeypatch.setattr(checkpoint.dcp, "save", interrupted)
    with pytest.raises(_Stop):
        checkpoint.save(tmp_path, 3, dropout_net(), None, {})
    assert list(tmp_path.iterdir()) == []  # the half-written step is gone


def test_a_decaying_schedule_resumed_at_another_length_is_refused(tmp_path) -> None:
    config = TrainConfig(micro_batch=8, lr_schedule="cosine", warmup=1)
    fit(dropout_net, noisy_data, config=config, steps=4, checkpoint=tmp_path / "a",
        checkpoint_every=2, validate=False)  # fmt: skip
    shutil.copytree(tmp_path / "a" / "step-00000002", tmp_path / "b" / "step-00000002")
    with pytest.raises(KilnError, match=r"cosine schedule's length \(--steps\) 4 → 6"):
        fit(dropout_net, noisy_data, config=config, steps=6, checkpoint=tmp_path / "b",
            resume=True, validate=False)  # fmt: skip
    rest = fit(dropout_net, noisy_data, config=config, steps=4, checkpoint=tmp_path / "b",
               resume=True, validate=False)  # fmt: skip
    assert rest["steps_this_run"] == 2
