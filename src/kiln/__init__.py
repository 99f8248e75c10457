"""Kiln: a hardware-aware graph compiler and performance toolkit for neural-network models."""

__version__ = "0.1.0"

from kiln.compiler import compile  # noqa: E402
from kiln.errors import KilnError  # noqa: E402
from kiln.runtime import Session  # noqa: E402

__all__ = ["KilnError", "Session", "__version__", "compile"]
