"""The user's code inside Kiln's loop: their model's forward, their dataset and its batching,
their loss. What fails there is the user's mistake, and is reported as one line (a KilnError)
saying what failed and where in their code, not as a crash of Kiln:

    with theirs("the model's forward", module, factory):
        output = model(inputs)

The place is the innermost frame of the user's own code (outside PyTorch, Kiln, Python's
library and installed packages); where none ran — a float tensor into PyTorch's own
nn.Embedding — it is where their model, dataset or function is defined.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import re
import sysconfig
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from kiln.errors import KilnError, a_type

_KILN = os.path.join(str(Path(__file__).resolve().parents[1]), "")
# Files under these are not the user's.
_LIBRARIES = tuple(
    os.path.join(os.path.realpath(path), "")
    for path in (
        _KILN,
        os.path.dirname(torch.__file__),
        *(sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")),
    )
)
# Where PyTorch runs the user's code when Kiln calls it: a module's forward, a DataLoader's
# dataset and collate.
_RUNS_USERS = (
    os.path.join("torch", "nn", "modules", "module.py"),
    os.path.join("torch", "utils", "data", ""),
)
_WORKER = "DataLoader worker process"  # a worker's error carries its traceback as text


@contextlib.contextmanager
def theirs(what: str, *code: Any, always: bool = False) -> Iterator[None]:
    """An exception raised inside by the user's code, or by PyTorch running it (see
    `raised_by_user`), becomes one KilnError line: `what` failed, the exception, and the
    place (the user's innermost frame, else where the first of `code` — their model,
    dataset or function — is defined). `always`: everything inside is theirs (a loss, the
    default one included, fails only on their outputs and targets). Kiln's own errors, and a
    collective that failed because another rank died, go on unchanged."""
    try:
        yield
    except KilnError:
        raise
    except Exception as exc:
        from kiln.train.launch import peer_failed

        if peer_failed(exc) or not (always or raised_by_user(exc)):
            raise
        raise KilnError(f"{what} failed: {_first_line(exc)}{_place(exc, code)}") from exc


def checked_loss(loss_fn: Callable[[Any, Any], Any], *code: Any) -> Callable[[Any, Any], Any]:
    """`loss_fn` run as the user's code, and refused where it returns what backward cannot
    start from (a float, a tensor of more than one element). `code`: where their targets
    come from (the dataset), for a failure inside a loss that is not theirs."""
    name = _named(loss_fn)
    if inspect.isclass(loss_fn):  # torch.nn:MSELoss would be built with (output, target)
        raise KilnError(
            f"the loss {name} is a class; give a function of (output, target), e.g. "
            "torch.nn.functional:mse_loss, or one of your own that calls an instance of it."
        )

    def loss(output: Any, target: Any) -> torch.Tensor:
        with theirs(f"the loss {name}", loss_fn, *code, always=True):
            value = loss_fn(output, target)
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return value
        got = (f"a tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor)
               else a_type(value))  # fmt: skip
        where = defined_at(loss_fn)
        raise KilnError(
            f"the loss {name} returned {got}; expected a one-element tensor to run backward "
            "from: return the loss tensor itself (not .item()), reduced with .mean()"
            + (f" ({where})" if where else "")
            + "."
        )

    return loss


def raised_by_user(exc: BaseException) -> bool:
    """Whether the user's code raised `exc`: a frame of theirs is in its traceback, or
    Kiln's innermost frame called into PyTorch where PyTorch runs their code (a module's
    forward, a DataLoader)."""
    frames = _frames(exc)
    if any(_is_users(path) for path, _ in frames):
        return True
    ours = [i for i, (path, _) in enumerate(frames) if os.path.realpath(path).startswith(_KILN)]
    if not ours or ours[-1] + 1 >= len(frames):
        return False
    called = frames[ours[-1] + 1][0]
    return any(entry in called for entry in _RUNS_USERS)


def defined_at(thing: Any) -> str:
    """'NAME, defined at FILE:LINE' for the user's function or class, or an object of a class
    of theirs; '' for PyTorch's, Kiln's or a builtin's."""
    target = thing if inspect.isfunction(thing) or inspect.isclass(thing) else type(thing)
    try:
        path = inspect.getsourcefile(target)
        line = inspect.getsourcelines(target)[1]
    except (OSError, TypeError):
        return ""
    if not path or not _is_users(path):
        return ""
    return f"{target.__qualname__}, defined at {path}:{line}"


def _frames(exc: BaseException) -> list[tuple[str, int]]:
    """(file, line) of each frame, outermost first; a DataLoader worker's own frames (its
    traceback is text in the message) after the main process's."""
    frames = [(f.filename, f.lineno or 0) for f in traceback.extract_tb(exc.__traceback__)]
    text = str(exc)
    if _WORKER in text:
        frames += [(path, int(n)) for path, n in re.findall(r'File "([^"]+)", line (\d+)', text)]
    return frames


def _is_users(path: str) -> bool:
    if path.startswith("<"):  # <frozen ...>, <string>
        return False
    real = os.path.realpath(path)
    return not any(real.startswith(library) for library in _LIBRARIES)


def _first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if lines and _WORKER in lines[0]:
        return lines[-1]  # the worker's own "Type: message"
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


def _place(exc: BaseException, code: tuple[Any, ...]) -> str:
    users = [f"{path}:{line}" for path, line in _frames(exc) if _is_users(path)]
    if users:
        return f" (at {users[-1]})"
    where = next((found for found in map(defined_at, code) if found), "")
    return f" ({where})" if where else ""


def _named(function: Any) -> str:
    from kiln.compress.loading import spec_of

    return spec_of(function)
