"""What `kiln train` says when the user's setup cannot go on: the words a user acts on."""

from __future__ import annotations

import json
import re

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402

from kiln.errors import KilnError, a_type  # noqa: E402
from kiln.train.config import Checkpointing, TrainConfig  # noqa: E402
from kiln.train.inputs import datasets  # noqa: E402
from kiln.train.loop import _check_loss  # noqa: E402
from kiln.train.memory import chosen_blocks  # noqa: E402


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        yield torch.zeros(4), 0


def streaming() -> Stream:
    return Stream()


class Flat(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def test_a_type_takes_its_article() -> None:
    from collections import OrderedDict

    assert a_type(OrderedDict()) == "an OrderedDict" and a_type([]) == "a list"


def test_an_iterable_dataset_is_named_by_the_users_function() -> None:
    with pytest.raises(KilnError, match=r"test_train_messages:streaming's dataset is a Stream"):
        datasets(streaming)


def test_checkpointing_without_blocks_says_how_to_name_modules_on_the_command_line() -> None:
    with pytest.raises(KilnError) as raised:
        chosen_blocks(Flat(), Checkpointing(policy="full"))
    config = re.search(r"--config '(.+)'", str(raised.value))
    assert config, raised.value
    # the example given is a config kiln train takes, naming a module type the model has
    chosen = TrainConfig().replace(**json.loads(config.group(1)))
    assert chosen_blocks(Flat(), chosen.checkpointing)


class _Run:
    pipeline = None

    def __init__(self, precision: str) -> None:
        self.config = TrainConfig(precision=precision)


def test_a_diverged_fp32_loss_gives_no_fp16_advice() -> None:
    with pytest.raises(KilnError) as fp32:
        _check_loss(float("nan"), 3, 0, _Run("fp32"))
    assert "fp16" not in str(fp32.value) and "learning rate" in str(fp32.value)
    with pytest.raises(KilnError, match="loss_scale.initial"):
        _check_loss(float("inf"), 1, 0, _Run("fp16"))


def test_more_ranks_than_cores_is_said_before_training(tmp_path) -> None:
    import os
    import subprocess
    import sys

    cores = len(os.sched_getaffinity(0))
    command = [sys.executable, "-m", "kiln", "train", "kiln.train.examples:digits_cnn",
               "--data", "kiln.train.examples:digits", "--batch", str(4 * (cores + 1)), "-o", ".",
               "--nproc", str(cores + 1), "--strategy", "ddp"]  # fmt: skip
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert f"--nproc {cores + 1} on {cores} cores" in " ".join(done.stderr.split())
    assert done.returncode == 2  # and the bad -o is still refused, before any rank starts


def test_counts_take_their_plural() -> None:
    from kiln.errors import counted

    assert (counted(1, "thread"), counted(0, "step"), counted(2, "step")) == (
        "1 thread",
        "0 steps",
        "2 steps",
    )


def test_omp_num_threads_is_the_user_s_thread_count(monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert TrainConfig().threads(cores=8) == 1
    assert TrainConfig(parallel={"threads_per_rank": 3}).threads(cores=8) == 3  # config first
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert TrainConfig(parallel={"strategy": "ddp", "ranks": 2}).threads(cores=8) == 4


def test_a_checkpoint_path_that_is_a_file_and_two_lengths_are_said_plainly(tmp_path) -> None:
    from kiln.train import fit
    from kiln.train.checkpoint import check_storage

    (tmp_path / "afile").write_text("")
    with pytest.raises(KilnError, match="is a file; checkpoints go in a directory"):
        check_storage(tmp_path / "afile")
    with pytest.raises(KilnError, match=r"exactly one of .* \(given: --steps, --time\)"):
        fit(Flat, streaming, steps=10, seconds=5.0)


def test_a_loss_class_is_refused_naming_a_function_to_give() -> None:
    from kiln.train.usercode import checked_loss

    with pytest.raises(
        KilnError, match="torch.nn.modules.loss:MSELoss is a class; give a function"
    ):
        checked_loss(nn.MSELoss)
