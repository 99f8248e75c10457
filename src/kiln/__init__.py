"""Kiln: a hardware-aware graph compiler and performance toolkit for neural-network models."""

__version__ = "0.1.0"
