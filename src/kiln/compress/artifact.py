"""From a trained module to a verified Kiln artifact, and what it costs: parameters, FLOPs
(kiln.cost on the exported ONNX), P50 latency and accuracy on the held-out test split."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn

import kiln
from kiln.artifact import Artifact
from kiln.compress.data import Dataset, Split, batches
from kiln.cost import count_flops
from kiln.frontend import to_onnx

BATCH = 64  # the batch P50 and FLOPs are stated at: compute, not overhead, dominates
CALIBRATION_BATCHES = 8


@dataclass
class Built:
    """One compiled method: the artifact and the exported graph it was compiled from."""

    artifact: Artifact
    exported: onnx.ModelProto


def export(module: nn.Module, example: torch.Tensor) -> onnx.ModelProto:
    """The module as ONNX at the example's batch (KilnError naming the module when torch
    cannot export it, e.g. data-dependent control flow). The batch is static: with a dynamic
    one torch 2.13 decomposes fake-quantization into an op the ONNX exporter lacks
    (fake_quantize_per_tensor_affine_cachemask)."""
    return to_onnx(module, (example,))


def build(
    module: nn.Module,
    output: str | os.PathLike,
    data: Dataset,
    *,
    precision: str = "fp32",
    metric: str = "top1",
    max_drop: float = 0.01,
    force: bool = True,
    say: Callable[[str], None] | None = None,
) -> Built:
    """Export `module`, compile it at `precision` (int8: the model's own QDQ when it has been
    through QAT, else calibrated on training images under the accuracy budget) and verify it
    on validation images. Writes only the finished artifact."""
    # The one place a module becomes ONNX: kiln.compile(module, example_inputs=...) once the
    # front-end takes a module end to end.
    example = _batch(data.val.x)
    exported = export(module, example)
    name = exported.graph.input[0].name
    inputs = {name: example.numpy()}
    with tempfile.TemporaryDirectory(prefix="kiln-compress-") as scratch:
        calib = None
        if precision == "int8":
            calib = str(Path(scratch) / "calib.npz")
            np.savez(calib, **{name: _calibration(data.train)})
        artifact = kiln.compile(
            exported, output, precision=precision, inputs=inputs, calib=calib, metric=metric,
            max_drop=max_drop, force=force, progress=say,
        )  # fmt: skip
    return Built(artifact, exported)


def _batch(x: torch.Tensor, start: int = 0) -> torch.Tensor:
    """BATCH inputs from `start`, wrapping around a split smaller than that."""
    index = torch.arange(start, start + BATCH) % len(x)
    return x[index]


def _calibration(split: Split) -> np.ndarray:
    """A stack of training batches (samples on the first axis, as --calib reads them)."""
    count = min(CALIBRATION_BATCHES, max(1, len(split) // BATCH))
    return np.stack([_batch(split.x, i * BATCH).numpy() for i in range(count)])


def params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def flops(exported: onnx.ModelProto, batch: int = BATCH) -> int:
    """Matrix-product FLOPs of the exported graph (at `batch` if its batch is symbolic)."""
    dims = {
        value.type.tensor_type.shape.dim[0].dim_param: batch
        for value in exported.graph.input
        if value.type.tensor_type.shape.dim and value.type.tensor_type.shape.dim[0].dim_param
    }
    return count_flops(exported, dims)


def session_at(path: str | os.PathLike):
    """A runtime session on the artifact at `path` (its recorded engine settings)."""
    from kiln.runtime import Session

    return Session(path)


def artifact_accuracy(artifact: Artifact, split: Split) -> float:
    """Top-1 accuracy of the compiled artifact itself on `split`."""
    runner = session_at(artifact.path)
    name = runner.input_names[0]
    right = 0
    for x, y in batches(split, BATCH):
        padded = np.zeros((BATCH, *x.shape[1:]), dtype=np.float32)  # the artifact's batch
        padded[: len(x)] = x.numpy()
        logits = runner.run(None, {name: padded})[0][: len(x)]
        right += int((np.argmax(logits, axis=-1) == y.numpy()).sum())
    return right / max(len(split), 1)
