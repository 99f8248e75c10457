"""The trained model out of Kiln: its weights under the names of the user's own module, a
`kiln train` checkpoint loaded into a plain module, and the model written as a state_dict
(`.pt`), an ONNX model (`.onnx`, for `kiln optimize` and `kiln serve`) or a torch.export
program (`.pt2`).

    model = kiln.train.load("ckpt/", make_model())     # the newest whole checkpoint
    torch.save(prepared.state_dict(), "model.pt")      # in the user's own loop

Wrappers rename parameters (torch.compile `_orig_mod.`, DDP `module.`, the checkpoint
wrapper's prefix) and shard them (FSDP2's DTensors, a pipeline rank's stage):
torch.distributed.checkpoint's state-dict API undoes both, as it does when it saves.
"""

from __future__ import annotations

import copy
import io
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as torch_dist
from torch import nn

from kiln.errors import KilnError, a_type

if TYPE_CHECKING:
    from kiln.train.prepared import Prepared

FORMATS = (".onnx", ".pt2")  # what --export writes, by the file's suffix
_STAGE = re.compile(r"^stage\d+\.")  # an interleaved pipeline rank's names (parallel.py)


def load(checkpoint: str | os.PathLike, model: nn.Module) -> nn.Module:
    """`model` — a plain module built as the trained one was — with the weights of a
    `kiln train` checkpoint: a `step-NNNNNNNN` directory, or the checkpoint directory (its
    newest whole checkpoint). Returns `model`, in place."""
    from kiln.train import checkpoint as checkpoints

    if not isinstance(model, nn.Module):
        raise KilnError(f"load: the model is {a_type(model)}; expected an nn.Module "
                        "built as the trained one was.")  # fmt: skip
    checkpoints.load(checkpoint, model, None)
    return model


def plain_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights, on the CPU, under the user's own module's names. FSDP2's
    shards are gathered: under FSDP2 every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {name: value.detach().cpu() for name, value in state.items()}


def gathered_state_dict(prepared: Prepared) -> dict[str, torch.Tensor]:
    """`plain_state_dict` of the whole model on every rank: a pipeline's stages gathered
    from their ranks (every rank must call it)."""
    state = plain_state_dict(prepared.model)
    if prepared.pipeline is None or not torch_dist.is_initialized():
        return state
    parts: list[Any] = [None] * torch_dist.get_world_size()
    torch_dist.all_gather_object(parts, {_STAGE.sub("", k): v for k, v in state.items()})
    return {name: value for part in parts for name, value in part.items()}


def check_outputs(save: str | os.PathLike | None, export: str | os.PathLike | None) -> None:
    """Refuse, before any training, a --save or --export that could not be written."""
    from kiln.home import output_problem

    if export is not None and Path(export).suffix not in FORMATS:
        raise KilnError(f"--export {export}: give a .onnx file (for kiln optimize and kiln "
                        "serve) or a .pt2 file (torch.export.save).")  # fmt: skip
    for flag, path in (("--save", save), ("--export", export)):
        problem = output_problem(Path(path)) if path is not None else None
        if problem:
            raise KilnError(f"{flag} {path}: {problem}.")


def write(prepared: Prepared, save: str | None, export: str | None, example: Any,
          template: nn.Module | None = None) -> dict[str, str]:  # fmt: skip
    """The trained model written by rank 0 (every rank calls it: the weights may be spread
    over them): `save` a state_dict with plain names (torch.save), `export` an ONNX model or
    a torch.export program traced on `example` (one batch of inputs) with a dynamic batch
    dim. `template` is a plain module to export where the trained one is no longer plain
    (FSDP2 shards it in place). What was written, by flag."""
    if save is None and export is None:
        return {}
    state = gathered_state_dict(prepared)
    if prepared.dist.rank != 0:
        return {}
    written = {}
    if save is not None:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        _write(Path(save), buffer.getvalue(), "--save")
        written["save"] = str(save)
    if export is not None:
        # The module the user gave: rank 0's copy of it takes the gathered weights (unwrap()
        # would gather them again, a collective this rank alone cannot enter).
        source = template if template is not None else prepared._user
        assert source is not None
        try:
            export_module(plain_module(source, state), example, Path(export))
        except KilnError as exc:  # after the training: say where its weights are
            kept = f"the trained weights are in {save}" if save else "give --save to keep them"
            raise KilnError(f"--export {export}: {exc} ({kept}).") from None
        written["export"] = str(export)
    return written


def plain_module(module: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """A CPU copy of `module` holding `state`, the checkpoint wrappers (which only change
    what backward keeps) and a pipeline's split points taken out: what an inference export
    traces."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    plain = copy.deepcopy(module).cpu()
    for name, wrapper in list(plain.named_modules()):
        if isinstance(wrapper, CheckpointWrapper):
            parent_name, _, child = name.rpartition(".")
            parent = plain.get_submodule(parent_name) if parent_name else plain
            inner = wrapper._checkpoint_wrapped_module
            if isinstance(parent, nn.ModuleList | nn.Sequential) and child.isdigit():
                parent[int(child)] = inner
            else:
                setattr(parent, child, inner)
    remove_split_points(plain)
    plain.load_state_dict(state)
    return plain


def remove_split_points(module: nn.Module) -> None:
    """Give back the forwards torch.distributed.pipelining replaced, in place, to mark where
    the stages begin (`annotate_split_points`): the marker is an op no exporter knows."""
    for child in module.modules():
        if "_orig_forward" in vars(child):
            del child.forward, child._orig_forward  # the instance's: the class's comes back


def export_module(module: nn.Module, example: Any, path: Path) -> None:
    """`module` traced on `example` (its first positional input, a batch) with the batch dim
    dynamic, written to `path`: ONNX through kiln.frontend, or a torch.export program."""
    from kiln.frontend.export import describe, eval_mode, export_failure, quiet, to_onnx

    if not isinstance(example, torch.Tensor):
        raise KilnError(f"--export {path}: the model's input is {a_type(example)}; "
                        "exporting needs a tensor input.")  # fmt: skip
    example = example.cpu()
    if example.shape[0] < 2:  # torch.export specialises a dim of size 1: trace on two
        example = torch.cat([example, example])
    if path.suffix == ".onnx":
        proto = to_onnx(module, (example,), dynamic_shapes=({0: "batch"},))
        _write(path, proto.SerializeToString(), "--export")
        return
    batch = torch.export.Dim("batch")
    with eval_mode(module), quiet():
        try:
            program = torch.export.export(module, (example,), dynamic_shapes=({0: batch},))
        except Exception as exc:  # torch.export's errors vary by release and step
            raise KilnError(export_failure(describe(module), exc)) from None
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    _write(path, buffer.getvalue(), "--export")


def _write(path: Path, data: bytes, flag: str) -> None:
    from kiln.home import atomic_write_bytes

    try:
        atomic_write_bytes(path, data)
    except OSError as exc:
        raise KilnError(f"{flag} {path}: cannot write ({exc.strerror or exc}).") from None
