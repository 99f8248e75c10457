"""Knowledge distillation: a smaller student learns from the teacher's soft targets (its
temperature-softened class probabilities, which say *how* wrong each other class is) and from
the hard labels.

loss = α · T² · KL(softmax(teacher / T) ‖ softmax(student / T)) + (1 − α) · CE(student, y);
the T² keeps the soft term's gradients on the scale of the hard term's (Hinton et al., 2015).
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.compress.data import Dataset
from kiln.compress.models import DigitsCNN, PatchTransformer
from kiln.compress.train import Loss, Recipe, Tick, fit

TEMPERATURE = 4.0
ALPHA = 0.7


def distillation_loss(
    teacher: nn.Module, temperature: float = TEMPERATURE, alpha: float = ALPHA
) -> Loss:
    """The loss of a student trained against `teacher` (run without gradients on each batch)."""
    teacher.eval()

    def loss(logits: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            soft_targets = (teacher(x) / temperature).log_softmax(dim=-1)
        soft = nn.functional.kl_div(
            (logits / temperature).log_softmax(dim=-1), soft_targets, reduction="batchmean",
            log_target=True,
        )  # fmt: skip
        hard = nn.functional.cross_entropy(logits, y)
        return alpha * temperature**2 * soft + (1 - alpha) * hard

    return loss


def distill(
    teacher: nn.Module,
    student: nn.Module,
    data: Dataset,
    recipe: Recipe,
    tick: Tick | None = None,
    deadline: float | None = None,
) -> nn.Module:
    """Train `student` (in place) on `data` against `teacher`'s soft targets and the labels."""
    return fit(student, data, recipe, distillation_loss(teacher), tick=tick, deadline=deadline)


def builtin_student(model: nn.Module) -> nn.Module | None:
    """A fresh student of the built-in models: the CNN at half width with one conv per stage,
    the transformer at half depth and width (same head width). None for any other model:
    its student is the caller's to give."""
    if isinstance(model, DigitsCNN):
        widths = tuple(max(1, conv.out_channels // 2) for conv in _stage_convs(model))
        return DigitsCNN(widths, convs=1, classes=model.classifier.out_features)
    if isinstance(model, PatchTransformer):
        first = model.blocks[0].attn
        heads = max(1, first.num_heads // 2)
        dim = heads * first.head_dim
        side = int(model.position.shape[1] ** 0.5) * model.embed.kernel_size[0]
        return PatchTransformer(
            dim=dim, depth=max(1, len(model.blocks) // 2), heads=heads,
            patch=model.embed.kernel_size[0], side=side, classes=model.classifier.out_features,
        )  # fmt: skip
    return None


def _stage_convs(model: DigitsCNN) -> list[nn.Conv2d]:
    """The last conv of each stage (a stage ends at a pooling layer)."""
    convs, last = [], None
    for layer in model.features:
        if isinstance(layer, nn.MaxPool2d) and last is not None:
            convs.append(last)
        elif isinstance(layer, nn.Sequential):
            last = layer[0]
    return convs
