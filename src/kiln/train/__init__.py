"""A user's PyTorch training made faster: one `TrainConfig` (precision and loss scaling,
accumulation, activation checkpointing, torch.compile, ddp/fsdp2/pipeline on torch.distributed,
the data loader) applied to the user's own loop (`prepare`) or Kiln's (`fit`), ranks started
by torchrun.

    from kiln.train import TrainConfig, prepare
    prepared = prepare(model, optimizer, TrainConfig(precision="bf16", accumulation=4))
    for x, y in prepared.loader(dataset):
        with prepared.autocast():
            loss = loss_fn(prepared.model(x), y)
        prepared.backward(loss)
        prepared.step()

The trained model comes back as the user's own module (`prepared.unwrap()`), its weights under
that module's names (`prepared.state_dict()`), or from a checkpoint into a module the user
builds (`kiln.train.load(checkpoint, module)`); `fit(..., save=, export=)` writes it.

`kiln.train.config` needs no PyTorch; everything else does (`pip install torch`).
"""

from __future__ import annotations

from typing import Any

from kiln.errors import KilnError
from kiln.train.config import (
    Checkpointing,
    Loader,
    LossScale,
    Parallel,
    TrainConfig,
    read_config,
)

__all__ = [
    "Checkpointing",
    "Loader",
    "LossScale",
    "Parallel",
    "Prepared",
    "TrainConfig",
    "fit",
    "load",
    "prepare",
    "read_config",
    "require_torch",
]


def require_torch(what: str) -> None:
    """KilnError naming `what` when PyTorch is not installed (it is an optional extra)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        raise KilnError(f"{what} needs PyTorch: pip install torch.")


def __getattr__(name: str) -> Any:
    # PyTorch loads when a function that needs it is first used, not on `import kiln.train`.
    if name in ("prepare", "Prepared"):
        import importlib

        return getattr(importlib.import_module("kiln.train.prepared"), name)
    if name == "fit":
        from kiln.train.loop import fit

        return fit
    if name == "load":  # a checkpoint's weights into a plain module
        from kiln.train.export import load

        return load
    raise AttributeError(f"module 'kiln.train' has no attribute {name!r}")
