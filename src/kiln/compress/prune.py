"""Structured pruning: remove the least important channels, attention heads and FFN neurons.

`prune(model, 0.5)` returns a pruned *deep copy* (the model passed in is not touched) whose
weight tensors are physically smaller: removed units are cut out, not masked, so parameters
and FLOPs drop and the exported ONNX graph is smaller. Each prunable layer loses the same
fraction `amount` of its units (at least one unit stays), ranked per layer by `magnitude`
or first-order `taylor` importance (see kiln.compress.importance). Fine-tune afterwards to
recover accuracy.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain, islice

import torch
from torch import nn

from kiln.compress import importance as scoring
from kiln.compress.prune_graph import find_groups, removed_units
from kiln.compress.surgery import Group
from kiln.errors import KilnError

TARGETS = ("channels", "heads", "neurons")
IMPORTANCE = ("magnitude", "taylor")


@dataclass(frozen=True)
class LayerPrune:
    """One pruned layer: its units (channels, heads, neurons) and its own parameters."""

    name: str
    kind: str
    units_before: int
    units_after: int
    params_before: int
    params_after: int
    kept: tuple[int, ...]  # the surviving units' original indices


@dataclass(frozen=True)
class PruneReport:
    """The pruned copy (`model`) and what was removed, layer by layer."""

    model: nn.Module
    amount: float
    importance: str
    layers: tuple[LayerPrune, ...]
    skipped: tuple[tuple[str, str], ...]  # (module, why its units were left whole)
    params_before: int
    params_after: int


def prune(
    model: nn.Module,
    amount: float = 0.5,
    *,
    importance: str = "magnitude",
    data: Iterable | None = None,
    loss_fn: scoring.LossFn | None = None,
    targets: Sequence[str] = TARGETS,
    batches: int = 8,
) -> PruneReport:
    """Prune `amount` of every prunable layer's units from a deep copy of `model`.

    `data` yields (inputs, labels) batches; `taylor` needs it (the first `batches` are used,
    with `loss_fn(logits, labels)`, cross-entropy by default), and when given, the pruned
    copy is also run on the first batch to prove that it still works.
    """
    targets = (targets,) if isinstance(targets, str) else tuple(targets)
    _check_arguments(model, amount, importance, data, targets)
    sample = list(islice(data, batches)) if data is not None else []
    if data is not None and not sample:
        raise KilnError("pruning got no data: `data` yielded no (inputs, labels) batch.")
    try:
        pruned = copy.deepcopy(model)
    except Exception as error:  # a module holding something uncopyable: a lock, a handle
        raise KilnError(
            f"cannot copy {type(model).__name__} to prune it ({scoring.first_line(error)})."
        ) from error
    found = find_groups(pruned, set(targets), amount)
    if found.candidates == 0:
        raise KilnError(
            f"nothing to prune in {type(model).__name__}: found no {' / '.join(targets)} "
            "(plain Conv channels, attention heads, or Linear -> activation -> Linear neurons)."
        )
    groups = [g for g in found.groups if removed_units(g.units, amount) > 0]
    scores = _scores(pruned, groups, importance, sample, loss_fn)
    layers = tuple(_remove(g, s, amount) for g, s in zip(groups, scores, strict=True))
    if sample:
        _check_runs(model, pruned, sample[0][0])
    return PruneReport(
        pruned, amount, importance, layers, tuple(found.skipped), _count(model), _count(pruned)
    )


def _check_arguments(model, amount, importance, data, targets) -> None:
    if not isinstance(model, nn.Module):
        raise KilnError(f"prune needs a torch.nn.Module, got {type(model).__name__}.")
    if not isinstance(amount, int | float) or not 0.0 <= amount < 1.0:
        raise KilnError(f"prune amount must be in [0, 1), got {amount}.")
    if importance not in IMPORTANCE:
        raise KilnError(f"unknown importance {importance!r}; use one of {', '.join(IMPORTANCE)}.")
    if importance == "taylor" and data is None:
        raise KilnError("taylor importance needs data: pass data=(inputs, labels) batches.")
    unknown = set(targets) - set(TARGETS)
    if unknown or not targets:
        raise KilnError(f"unknown prune targets {sorted(unknown)}; use some of {TARGETS}.")


def _scores(model, groups: list[Group], importance: str, sample, loss_fn) -> list[torch.Tensor]:
    if not groups:
        return []
    if importance == "taylor":
        return scoring.taylor(model, groups, sample, loss_fn, len(sample))
    return [scoring.magnitude(g) for g in groups]


def _remove(group: Group, score: torch.Tensor, amount: float) -> LayerPrune:
    keep = _keep(score, group.units - removed_units(group.units, amount))
    before = _params(group)
    group.remove(keep)
    kept = tuple(keep.tolist())
    return LayerPrune(group.name, group.kind, group.units, len(kept), before, _params(group), kept)


def _keep(score: torch.Tensor, count: int) -> torch.Tensor:
    """The `count` highest-scoring units, in their original order (ties keep the first)."""
    order = torch.argsort(score, descending=True, stable=True)
    return order[:count].sort().values


def _params(group: Group) -> int:
    modules = chain([group.owner], group.followers)
    return sum(p.numel() for m in modules for p in m.parameters())


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _check_runs(original: nn.Module, pruned: nn.Module, inputs: object) -> None:
    """The pruned copy must run on real inputs and give outputs of the original's shape."""
    shapes = []
    for module in (original, pruned):
        training = module.training
        module.eval()
        try:
            with torch.no_grad():
                shapes.append(tuple(scoring.run(module, inputs).shape))
        except (RuntimeError, ValueError, TypeError, IndexError) as error:
            if module is original:
                raise KilnError(
                    f"pruning data does not fit {type(original).__name__} "
                    f"({scoring.first_line(error)}); `data` must yield (inputs, labels) it accepts."
                ) from error
            raise KilnError(
                f"the pruned {type(original).__name__} fails to run ({scoring.first_line(error)}): "
                "a layer relies on a width that pruning changed; leave that target out."
            ) from error
        finally:
            module.train(training)
    if shapes[0] != shapes[1]:
        raise KilnError(
            f"pruning changed the output shape of {type(original).__name__} from {shapes[0]} "
            f"to {shapes[1]}; leave the layer that makes it out of targets."
        )
