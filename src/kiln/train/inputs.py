"""What `fit` is given, read and checked before training: the model (a module or a factory),
the data (a Dataset, {"train", "val"}, or a function of either), its first sample and one
collated micro-batch, and the tokens per sample of a sequence input."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kiln.errors import KilnError, a_type
from kiln.train.usercode import defined_at


def model_of(model: Any) -> nn.Module:
    from kiln.compress.loading import call

    if isinstance(model, nn.Module):
        return model
    return call(model, "the model factory", nn.Module, "a torch.nn.Module")


def datasets(data: Any) -> tuple[Any, Any]:
    from kiln.compress.loading import spec_of

    named = f"{spec_of(data)}'s dataset" if callable(data) else "the dataset"
    if callable(data) and not hasattr(data, "__getitem__"):
        from kiln.compress.loading import call

        data = call(data, "the dataset function", object, "a Dataset or {train, val}")
    if isinstance(data, dict):
        if "train" not in data:
            raise KilnError(
                f"the dataset dict has keys {sorted(data)}; expected 'train' (and 'val')."
            )
        return data["train"], data.get("val")
    if not hasattr(data, "__getitem__") or not hasattr(data, "__len__"):
        raise KilnError(
            f"{named} is {a_type(data)}; expected a map-style Dataset (__getitem__, "
            "__len__) of (input, target) pairs, or {'train', 'val'}: an IterableDataset "
            "cannot be sharded across ranks, shuffled or resumed at a step."
        )
    return data, None


def first_sample(dataset: Any) -> Any:
    where = defined_at(dataset)
    where = f" ({where})" if where else ""
    if len(dataset) == 0:
        raise KilnError(f"the training dataset is empty{where}.")
    sample = dataset[0]
    if not isinstance(sample, tuple | list) or len(sample) != 2:
        raise KilnError(
            f"the dataset's samples are {type(sample).__name__}s; expected (input, target) "
            f"pairs, e.g. return x, y from __getitem__{where}."
        )
    for part, what in zip(sample, ("input", "target"), strict=True):
        if not isinstance(part, torch.Tensor | int | float):
            raise KilnError(f"the dataset's {what} is {a_type(part)}; expected a "
                            f"tensor or a number{where}.")  # fmt: skip
    return sample


def collate_example(dataset: Any, micro_batch: int) -> tuple[Any, Any]:
    """One micro-batch, collated as the loader will: the pipeline traces its stages on it."""
    from torch.utils.data import default_collate

    count = min(micro_batch, len(dataset))
    if count < micro_batch:
        raise KilnError(
            f"the training dataset has {len(dataset)} samples, fewer than one micro_batch "
            f"({micro_batch}: --batch over the data-parallel ranks and --accumulation); lower "
            "--batch or raise --accumulation."
        )
    return default_collate([dataset[i] for i in range(count)])


def tokens_per_sample(sample: Any) -> int | None:
    """Tokens per sample where the input is a sequence of ids (an integer tensor, 1-D)."""
    x = sample[0]
    if isinstance(x, torch.Tensor) and not x.is_floating_point() and x.dim() == 1:
        return int(x.numel())
    return None
