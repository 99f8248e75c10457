"""Kiln: a hardware-aware graph compiler and performance toolkit for neural-network models.

`import kiln` is light: the compiler, the runtime and the engines load on first use.
"""

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "compile": ("kiln.compiler", "compile"),
    "CompileConfig": ("kiln.config", "CompileConfig"),
    "KilnError": ("kiln.errors", "KilnError"),
    "Session": ("kiln.tune.feedback", "Session"),  # the runtime Session, + feedback=True
    "split": ("kiln.compiler.split", "split"),  # an edge part and a server part (kiln split)
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'kiln' has no attribute '{name}'")
    import importlib

    module, attribute = _LAZY[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


__all__ = ["CompileConfig", "KilnError", "Session", "__version__", "compile", "split"]
