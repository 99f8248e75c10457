"""PyTorch is an optional extra: one clear line when it is missing."""

from __future__ import annotations

from types import ModuleType

from kiln.errors import KilnError

INSTALL = "pip install 'kiln-ml[torch]' (torch==2.13.0 is the CPU wheel)"


def require_torch(what: str) -> ModuleType:
    """`import torch`, or a KilnError saying that `what` needs it and how to install it."""
    try:
        import torch
    except ImportError:
        raise KilnError(f"{what} needs PyTorch: {INSTALL}.") from None
    return torch
