"""Mixed precision: autocast to bf16 or fp16, modules kept in fp32, and fp16's loss scaler.

bf16 keeps fp32's exponent range, so it needs no loss scaling; fp16 does — gradients below
2⁻²⁴ vanish — so its loss is multiplied by a dynamic scale (torch.amp.GradScaler: a step whose
gradients overflow is skipped and the scale backs off; clean steps grow it back).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from kiln.errors import KilnError
from kiln.train.config import TrainConfig

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(config: TrainConfig, device: torch.device) -> contextlib.AbstractContextManager:
    """The forward's autocast context for `config.precision` (a no-op context for fp32)."""
    if config.precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=DTYPES[config.precision])


def keep_in_fp32(model: nn.Module, names: tuple[str, ...], device: torch.device) -> list[str]:
    """Run the modules named — by type ("LayerNorm") or qualified name ("head") — in fp32 under
    autocast, their floating inputs cast up; the qualified names of the modules changed.
    KilnError naming what matched nothing."""
    changed: list[str] = []
    for name in names:
        hits = [(n, m) for n, m in model.named_modules() if n == name or type(m).__name__ == name]
        if not hits:
            raise KilnError(
                f"keep_fp32 '{name}': no module of that type or name in the model (types: "
                f"{', '.join(sorted({type(m).__name__ for m in model.modules()}))})."
            )
        for qualified, module in hits:
            _force_fp32(module, device)
            changed.append(qualified or type(module).__name__)
    return changed


def _force_fp32(module: nn.Module, device: torch.device) -> None:
    forward = module.forward

    def fp32_forward(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device_type=device.type, enabled=False):
            return forward(*_up(args), **_up(kwargs))

    module.forward = fp32_forward  # type: ignore[method-assign]


def _up(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.float()
    if isinstance(value, tuple | list):
        return type(value)(_up(v) for v in value)
    if isinstance(value, dict):
        return {k: _up(v) for k, v in value.items()}
    return value


def grad_scaler(config: TrainConfig, device: torch.device, sharded: bool) -> Any:
    """fp16's dynamic loss scaler with the config's knobs (disabled, a pass-through, for fp32
    and bf16). FSDP2's sharded gradients take the sharded scaler (overflow found across
    ranks)."""
    scale = config.loss_scale
    kwargs = {"init_scale": scale.initial, "growth_factor": scale.growth,
              "backoff_factor": scale.backoff, "growth_interval": scale.interval,
              "enabled": config.precision == "fp16"}  # fmt: skip
    if sharded:
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device.type, **kwargs)
    return torch.amp.GradScaler(device.type, **kwargs)
