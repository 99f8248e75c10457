"""Training checkpoints with torch.distributed.checkpoint: each rank writes its own shards
(DDP, FSDP2 and pipeline stages alike; one process without a group too), and a checkpoint
exists only once it is whole.

    directory/step-00000200/   .metadata, the ranks' shards, extra.pt, kiln-checkpoint.json
    directory/.step-00000300.partial/   being written (a crash leaves it; it is never read)

Every rank calls `save` and `load`; rank 0 writes the small files, renames the finished
checkpoint into place and keeps the newest `KEEP`.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import pickle
import random
import re
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as torch_dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from kiln.errors import KilnError
from kiln.home import move_into_place, output_problem

KEEP = 2  # complete checkpoints kept; older ones are deleted after each save
MARKER = "kiln-checkpoint.json"  # written last: its presence means the checkpoint is whole
EXTRA = "extra.pt"
FORMAT = 2  # 2: the record holds the config, extra.pt the samples taken and RNG states
_NAME = re.compile(r"step-(\d{8,})")
# A save in progress, or (after a crash mid-rename) the checkpoint it was replacing.
_PARTIAL = re.compile(r"\.step-(\d{8,})\.(partial|[0-9a-f]+\.old)")


def save(
    directory: str | os.PathLike,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    extra: dict[str, Any],
    config: dict[str, Any] | None = None,
    keep: int = KEEP,
    schedule_steps: int | None = None,
) -> Path:
    """Write `directory/step-{step:08d}` from every rank; return its path. The newest
    `keep` complete checkpoints of `directory` stay.

    `extra` (tensors, numbers, strings and lists/dicts of them: the loss scaler, the sampler,
    RNG states) is kept by rank 0 and given back by `load`; `config`, the TrainConfig (as
    JSON) the checkpoint was made under, goes in its record for `made_under`."""
    directory = Path(directory)
    final = directory / f"step-{step:08d}"
    partial = directory / f".step-{step:08d}.partial"
    main = _rank() == 0
    if main:
        _prepare(directory, partial)
    _barrier()  # the partial directory is fresh before any rank writes into it
    model_state, optim_state = get_state_dict(model, _optimizers(optimizer))
    try:
        with _one_process_is_meant():
            dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=partial)
        if main:
            _save_extra(extra, partial / EXTRA)
            marker = {"step": step, "format": FORMAT, "config": config,
                      "schedule_steps": schedule_steps}  # fmt: skip
            (partial / MARKER).write_text(json.dumps(marker))
    except (OSError, CheckpointException) as exc:  # CheckpointException: a rank's write failed
        if main:  # every rank gets DCP's failure; a half-written step must not stay behind
            shutil.rmtree(partial, ignore_errors=True)
        stop = _stop_inside(exc)
        if stop is not None:  # Ctrl-C in the middle of the write: a stop, not a disk's fault
            raise stop from None
        raise KilnError(_write_failed(directory, step, exc)) from None
    except BaseException:  # a stop signal outside DCP's writer: nothing partial either
        if main:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    _barrier()  # every rank's shards are written: the checkpoint is whole
    if main:
        _publish(partial, final)
        _prune(directory, keep)
    _barrier()  # no rank reads `final` before it is in place
    return final


def latest(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in `directory` (partial ones ignored), or None."""
    found = _complete(Path(directory))
    return found[-1][1] if found else None


def schedule_steps(path: str | os.PathLike) -> int | None:
    """The run length a decaying LR schedule spread over when the checkpoint was made (None:
    a constant schedule, or a checkpoint saved without it): a resume of another length
    would bend the decay mid-run."""
    return _record(_resolve(Path(path))).get("schedule_steps")


def made_under(path: str | os.PathLike) -> tuple[int, dict[str, Any] | None]:
    """(step, the TrainConfig as JSON) of a checkpoint, or of the newest one of a directory,
    read from its record alone (no process group, no model); the config is None for a
    checkpoint saved without one."""
    path = _resolve(Path(path))
    record = _record(path)
    return record["step"], record.get("config")


def load(
    path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[int, dict[str, Any]]:
    """Restore `model` and `optimizer` (wrapped as when saved: same strategy and ranks) from
    a checkpoint, or from the newest one of a directory; return (step, extra)."""
    path = _resolve(Path(path))
    step = _read_marker(path)
    model_state, optim_state = get_state_dict(model, _optimizers(optimizer))
    state = {"model": model_state, "optim": optim_state}
    try:
        with _one_process_is_meant():
            dcp.load(state, checkpoint_id=path)
        set_state_dict(
            model,
            _optimizers(optimizer),
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        extra = torch.load(path / EXTRA, weights_only=True)
    # DCP and torch.load fail in many ways (missing files, keys, shapes, pickles); each is a
    # checkpoint this model cannot take. CheckpointException is a BaseException.
    except (Exception, CheckpointException) as exc:
        raise KilnError(
            f"{path}: damaged, or not a checkpoint of this model and optimizer "
            f"({_cause(exc)}); load another checkpoint, or train from the start."
        ) from None
    return step, extra


def rank_states(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's `state`, in rank order, on every rank (a collective: all ranks call it):
    what a checkpoint's `extra` keeps per rank, e.g. `rng_state()`."""
    if not torch_dist.is_initialized():
        return [state]
    states: list[Any] = [None] * torch_dist.get_world_size()
    torch_dist.all_gather_object(states, state)
    return states


def rng_state() -> dict[str, Any]:
    """This process's random generators — torch (CPU and CUDA), numpy, Python — as tensors,
    numbers and lists, which `load` reads back under weights_only."""
    kind, keys, position, has_gauss, gauss = np.random.get_state(legacy=True)
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, gauss],
        "python": [version, list(internal), gauss_next],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Put back what `rng_state` took: dropout and a dataset's own random draws go on as
    they would have in the run that saved it."""
    torch.set_rng_state(state["torch"])
    kind, keys, position, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), position, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _save_extra(extra: dict[str, Any], path: Path) -> None:
    """torch.save, refusing what `load` could not read back (it loads with weights_only)."""
    buffer = io.BytesIO()
    torch.save(extra, buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        what = f"a {found.group(1)}" if found else "an object torch.load(weights_only) refuses"
        raise KilnError(
            f"checkpoint extra holds {what}; keep tensors, numbers, strings and lists/dicts "
            "of them there (e.g. a state_dict())."
        ) from None
    path.write_bytes(buffer.getvalue())


@contextlib.contextmanager
def _one_process_is_meant() -> Iterator[None]:
    # Without a process group DCP warns that it assumes one process: here that is the intent.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def check_storage(directory: str | os.PathLike) -> None:
    """Refuse, before training, a checkpoint directory that cannot be created or written in
    (read-only, no permission, a file in the way): found at the first save, it would cost
    the training done until then."""
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise KilnError(f"--checkpoint {directory} is a file; checkpoints go in a directory: "
                        "give a directory's path (it is made if missing).")  # fmt: skip
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        problem = exc.strerror or str(exc)
    else:
        problem = output_problem(directory / MARKER, directory=True)
    if problem:
        raise KilnError(f"--checkpoint {directory}: cannot write checkpoints there ({problem}); "
                        "nothing was trained: choose another directory.")  # fmt: skip


def _write_failed(directory: Path, step: int, exc: BaseException) -> str:
    """What stopped the checkpoint of `step` being written, in one line."""
    full = _os_error(exc)
    if full is not None and full.errno == errno.ENOSPC:
        return (f"{directory}: no space left on device; the checkpoint of step {step} was not "
                "written (no partial one is left): free space there or choose another "
                "--checkpoint, then --resume from the newest whole one.")  # fmt: skip
    return f"{directory}: cannot write the checkpoint ({_cause(exc)})."


def _os_error(exc: BaseException) -> OSError | None:
    """The OSError under a failed write, if any: a rank's inside DCP's CheckpointException,
    or the one torch's file writer hides behind its own RuntimeError ("unexpected pos")."""
    if isinstance(exc, CheckpointException) and exc.failures:
        exc = next(iter(exc.failures.values()))[0]
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _stop_inside(exc: BaseException) -> BaseException | None:
    """A stop (Ctrl-C or SIGTERM as the CLI raises it: a BaseException that is no Exception)
    that DCP caught inside its writer and wrapped as a rank's failure; None for a real one."""
    if isinstance(exc, CheckpointException):
        for failure in exc.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, BaseException) and not isinstance(inner, Exception):
                return inner
    return None


def _cause(exc: BaseException) -> str:
    """One line: the first rank's own error inside DCP's CheckpointException (whose text is
    every rank's traceback), else the exception itself."""
    if isinstance(exc, CheckpointException) and exc.failures:
        exc = next(iter(exc.failures.values()))[0]
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:200]}"


def _optimizers(optimizer: torch.optim.Optimizer | None) -> list[torch.optim.Optimizer]:
    return [] if optimizer is None else [optimizer]


def _rank() -> int:
    return torch_dist.get_rank() if torch_dist.is_initialized() else 0


def _barrier() -> None:
    if torch_dist.is_initialized():
        torch_dist.barrier()


def _prepare(directory: Path, partial: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # left by a crash while saving this step
        partial.mkdir()
    except OSError as exc:
        raise KilnError(
            f"{directory}: cannot write checkpoints here ({exc.strerror or exc})."
        ) from None


def _publish(partial: Path, final: Path) -> None:
    """Rename the whole checkpoint into place; one saved before at this step goes once the
    rename is on disk."""
    move_into_place(partial, final, after=lambda: _sync(final.parent))


def _sync(directory: Path) -> None:
    # The renames are durable once the directory entry is on disk, not merely in the cache.
    handle = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def _prune(directory: Path, keep: int) -> None:
    for _, path in _complete(directory)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
    for child in directory.iterdir():  # partials of other steps: crashed saves of earlier runs
        if _PARTIAL.fullmatch(child.name) and child.is_dir():
            shutil.rmtree(child, ignore_errors=True)


def _complete(directory: Path) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    found = []
    for child in directory.iterdir():
        match = _NAME.fullmatch(child.name)
        if match and (child / MARKER).is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


def _resolve(path: Path) -> Path:
    if (path / MARKER).is_file():
        return path
    if not path.exists():
        raise KilnError(f"{path}: no such checkpoint or checkpoint directory.")
    if _NAME.fullmatch(path.name):
        raise KilnError(f"{path}: an incomplete checkpoint (no {MARKER}); load another.")
    found = latest(path)
    if found is None:
        raise KilnError(f"{path}: no complete checkpoint (step-NNNNNNNN) in this directory.")
    return found


def _read_marker(path: Path) -> int:
    return _record(path)["step"]


def _record(path: Path) -> dict[str, Any]:
    """The checkpoint's record (its step an int), once its files are all there."""
    missing = [name for name in (".metadata", EXTRA) if not (path / name).is_file()]
    if missing:
        raise KilnError(f"{path}: damaged checkpoint ({missing[0]} is missing); load another.")
    try:
        data = json.loads((path / MARKER).read_text())
        return {**data, "step": int(data["step"])}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise KilnError(f"{path}: damaged checkpoint record {MARKER} ({exc}).") from None
