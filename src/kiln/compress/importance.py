"""How much each unit of a prunable layer matters: one score per unit, higher means keep.

- `magnitude`: the L1 norm of the weights (and biases) that compute the unit: a channel's
  filter, a head's q/k/v rows, a neuron's row of the first Linear. No data needed.
- `taylor`: the first-order estimate of the loss change when the unit's output is zeroed,
  |sum of w * dL/dw| over the weights that *read* the unit (the next layer's columns), one
  absolute value per batch, summed over batches. Reading-side weights make this equal to
  |sum of activation * gradient| of the unit's output, unaffected by a BatchNorm behind it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from itertools import islice

import torch
import torch.nn.functional as F
from torch import nn

from kiln.compress.surgery import Group, unit_view
from kiln.errors import KilnError

Batch = tuple[object, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def magnitude(group: Group) -> torch.Tensor:
    """Per-unit L1 norm of the producing weights and biases."""
    score = torch.zeros(group.units, dtype=torch.float64)
    with torch.no_grad():
        for piece in group.producers:
            score += unit_view(piece.module.weight, piece).abs().sum(1).double().cpu()
            if piece.dim == 0 and piece.module.bias is not None:
                bias = piece.module.bias.reshape(group.units, -1)
                score += bias.abs().sum(1).double().cpu()
    return score


def taylor(
    model: nn.Module,
    groups: list[Group],
    data: Iterable[Batch],
    loss_fn: LossFn | None,
    batches: int,
) -> list[torch.Tensor]:
    """Per-unit first-order Taylor scores of every group, from up to `batches` batches."""
    scores = [torch.zeros(g.units, dtype=torch.float64) for g in groups]
    params = list(model.parameters())
    saved = [(p.requires_grad, p.grad) for p in params]
    training = model.training
    model.eval()  # BatchNorm statistics and dropout stay as they are; gradients still flow
    try:
        for p in params:
            p.requires_grad_(True)
        seen = 0
        for index, (inputs, labels) in enumerate(islice(data, batches)):
            _gradients(model, inputs, labels, loss_fn or _cross_entropy, index)
            for score, group in zip(scores, groups, strict=True):
                score += _batch_score(group)
            seen += 1
        if seen == 0:
            raise KilnError("taylor importance got no batches: `data` yielded nothing.")
    finally:
        for p, (grad_on, grad) in zip(params, saved, strict=True):
            p.requires_grad_(grad_on)
            p.grad = grad
        model.train(training)
    return scores


def run(model: nn.Module, inputs: object) -> torch.Tensor:
    """The model's output for one batch's inputs: a tensor, a tuple of them, or keywords."""
    inputs = _to(inputs, next(model.parameters()).device)
    if isinstance(inputs, dict):
        out = model(**inputs)
    elif isinstance(inputs, tuple | list):
        out = model(*inputs)
    else:
        out = model(inputs)
    return _logits(out)


def _gradients(model, inputs, labels, loss_fn: LossFn, index: int) -> None:
    model.zero_grad(set_to_none=True)
    device = next(model.parameters()).device
    try:
        loss = loss_fn(run(model, inputs), _to(labels, device))
        loss.backward()
    except (RuntimeError, ValueError, TypeError, IndexError) as error:
        raise KilnError(
            f"pruning data batch {index} does not fit the model ({first_line(error)}); "
            "`data` must yield (inputs, labels) that the model and loss_fn accept."
        ) from error


def first_line(error: BaseException) -> str:
    """An exception's first line: torch's messages run to many lines."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _batch_score(group: Group) -> torch.Tensor:
    score = torch.zeros(group.units, dtype=torch.float64)
    for piece in group.consumers:
        weight = piece.module.weight
        if weight.grad is None:
            continue  # this path did not reach the loss: it contributes nothing
        product = unit_view(weight.detach() * weight.grad, piece)
        score += product.sum(1).double().cpu()
    return score.abs()


def _logits(out: object) -> torch.Tensor:
    """The tensor to score: `.logits` of a transformers output, else the first output."""
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, Mapping):
        return next(iter(out.values()))
    if isinstance(out, tuple | list):
        return out[0]
    return out


def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels)


def _to(value: object, device: torch.device) -> object:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return type(value)(_to(v, device) for v in value)
    return value
