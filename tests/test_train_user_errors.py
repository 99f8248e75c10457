"""A mistake in the user's own model, dataset or loss, met inside `kiln train`'s loop, is theirs:
one line saying what failed and naming the place in their file (this one, which plays the
user's module), exit code 2 — in one process and on ranks — not a crash blamed on Kiln."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from kiln.errors import KilnError  # noqa: E402
from kiln.train import fit  # noqa: E402
from kiln.train.config import TrainConfig  # noqa: E402

VOCAB, CLASSES, LENGTH, SAMPLES, BATCH = 16, 4, 5, 32, 8
HERE = str(Path(__file__).resolve())


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens).mean(1))


class Sentences(Dataset):
    """Token ids and a class; `mistake` plants one of a user's usual data bugs."""

    def __init__(self, mistake: str = "") -> None:
        self.mistake = mistake

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        ragged = self.mistake == "ragged" or (self.mistake == "ragged later" and index >= BATCH)
        length = LENGTH + index % 3 if ragged else LENGTH
        tokens = torch.randint(0, VOCAB, (length,), generator=torch.Generator().manual_seed(index))
        label: Any = index % CLASSES
        if self.mistake == "float":
            tokens = tokens.float()
        if self.mistake == "range":
            label = CLASSES + 5
        if self.mistake == "str" and index >= BATCH:  # the first batch is fine, a later not
            label = "positive"
        return tokens, label


def tagger() -> nn.Module:
    return Tagger()


def float_tokens() -> Dataset:
    return Sentences("float")


def ragged() -> Dataset:
    return Sentences("ragged")


def ragged_later() -> Dataset:
    return Sentences("ragged later")


def out_of_range() -> Dataset:
    return Sentences("range")


def str_labels() -> Dataset:
    return Sentences("str")


def fine() -> Dataset:
    return Sentences()


def loss_as_float(output: torch.Tensor, target: torch.Tensor) -> float:
    return float(nn.functional.cross_entropy(output, target))


def loss_of_other_shapes(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target.float())


def _body(function: Any) -> int:
    """The line of a one-line function's (or method's) body."""
    return function.__code__.co_firstlineno + 1


def _defined(thing: Any) -> int:
    return inspect.getsourcelines(thing)[1]


CASES = {
    "float tensor into nn.Embedding": (float_tokens, None, f"{HERE}:{_body(Tagger.forward)}"),
    "ragged samples": (ragged, None, f"{HERE}:{_defined(Sentences)}"),
    "str label": (str_labels, None, f"{HERE}:{_defined(Sentences)}"),
    "label out of range": (out_of_range, None, f"{HERE}:{_defined(Sentences)}"),
    "loss returns a float": (fine, loss_as_float, f"{HERE}:{_defined(loss_as_float)}"),
    "loss of other shapes": (fine, loss_of_other_shapes, f"{HERE}:{_body(loss_of_other_shapes)}"),
}


def _fit(data: Any, loss: Any = None, workers: int = 0) -> str:
    config = TrainConfig(micro_batch=BATCH, loader={"workers": workers})
    with pytest.raises(KilnError) as raised:
        fit(tagger, data, loss=loss, config=config, steps=2, validate=False)
    message = str(raised.value)
    assert "\n" not in message
    return message


@pytest.mark.filterwarnings("ignore::UserWarning")  # PyTorch's own about the planted bugs
@pytest.mark.parametrize("case", list(CASES))
def test_a_mistake_in_the_users_code_is_one_line_naming_their_file_and_line(case: str) -> None:
    data, loss, place = CASES[case]
    message = _fit(data, loss)
    assert place in message, message


def test_a_batch_that_fails_in_a_loader_worker_says_the_workers_own_error() -> None:
    message = _fit(ragged_later, workers=1)
    assert "RuntimeError: stack expects each tensor to be equal size" in message, message
    assert f"{HERE}:{_defined(ragged_later)}" in message


@pytest.mark.timeout(120)
def test_on_two_ranks_the_cli_says_it_in_one_line_with_exit_code_2() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kiln", "train", "test_train_user_errors:tagger", "--data",
         "test_train_user_errors:float_tokens", "--batch", "8", "--steps", "2", "--nproc", "2"],
        capture_output=True, text=True, timeout=110, cwd=Path(__file__).parent,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("error: rank ")
    assert f"{HERE}:{_body(Tagger.forward)}" in lines[0]
    assert "Expected tensor for argument #1 'indices'" in lines[0]
