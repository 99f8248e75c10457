"""Bad input caught before any training: data of the wrong kind or shape, a model that cannot
take it. Each problem is one line naming what was expected and what came."""

from __future__ import annotations

import torch
from torch import nn

from kiln.compress.data import Dataset
from kiln.errors import KilnError, a_type


def check_data(module: nn.Module, data: object) -> None:
    """`data` is a Dataset whose splits `module` can classify (KilnError otherwise)."""
    if not isinstance(data, Dataset):
        raise KilnError(
            f"the data loader returned {a_type(data)}; expected a "
            "kiln.compress.data.Dataset (train/val/test splits of inputs and labels)."
        )
    for part in ("train", "val", "test"):
        _check_split(data, part)
    declared = getattr(module, "input_shape", None)
    got = tuple(data.train.x.shape[1:])
    if declared is not None and tuple(declared) != got:
        raise KilnError(
            f"dataset '{data.name}' yields inputs of shape (N, {_dims(got)}); "
            f"{type(module).__name__} expects (N, {_dims(tuple(declared))})."
        )
    _check_model_runs(module, data, got)


def _check_split(data: Dataset, part: str) -> None:
    split = getattr(data, part)
    x, y = split.x, split.y
    where = f"dataset '{data.name}' {part} split"
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.ndim < 2:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise KilnError(f"{where}: expected float inputs of shape (N, ...), got {shape}.")
    if not isinstance(y, torch.Tensor) or y.dtype != torch.int64 or y.ndim != 1:
        got = f"{tuple(y.shape)} {y.dtype}" if isinstance(y, torch.Tensor) else type(y).__name__
        raise KilnError(f"{where}: expected labels of shape (N,) int64 class ids, got {got}.")
    if len(x) != len(y) or len(y) == 0:
        raise KilnError(
            f"{where}: expected as many labels as inputs (N ≥ 1), got {len(x)} inputs and "
            f"{len(y)} labels."
        )
    if x.shape[1:] != data.train.x.shape[1:]:
        raise KilnError(
            f"{where}: expected inputs (N, {_dims(tuple(data.train.x.shape[1:]))}) like the "
            f"train split, got (N, {_dims(tuple(x.shape[1:]))})."
        )


def _check_model_runs(module: nn.Module, data: Dataset, got: tuple[int, ...]) -> None:
    name = type(module).__name__
    training = module.training
    module.eval()
    try:
        with torch.no_grad():
            logits = module(data.train.x[:2])
    except Exception as exc:  # whatever the model raises on inputs it cannot take
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise KilnError(
            f"{name} cannot take dataset '{data.name}' inputs of shape (N, {_dims(got)}) "
            f"({reason}); expected inputs the model was built for."
        ) from None
    finally:
        module.train(training)
    classes = int(max(int(s.y.max()) for s in (data.train, data.val, data.test))) + 1
    if not isinstance(logits, torch.Tensor) or logits.ndim != 2 or logits.shape[1] < classes:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits)
        raise KilnError(
            f"{name} returns {shape} on 2 inputs; expected logits (2, {classes}) for the "
            f"{classes} classes of dataset '{data.name}'."
        )


def _dims(shape: tuple[int, ...]) -> str:
    return ", ".join(str(d) for d in shape)
