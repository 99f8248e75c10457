"""Engines that run models: the only package that imports onnxruntime or openvino."""

from __future__ import annotations

from kiln.backends.base import Backend, Executable
from kiln.backends.ort import OrtBackend, OrtOptions
from kiln.errors import KilnError

BACKENDS: dict[str, type[Backend]] = {"ort": OrtBackend}


def get_backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise KilnError(f"unknown backend '{name}'; available: {', '.join(sorted(BACKENDS))}.")
    backend = BACKENDS[name]()
    if not backend.available():
        raise KilnError(f"backend '{name}' is not installed.")
    return backend


__all__ = ["BACKENDS", "Backend", "Executable", "OrtBackend", "OrtOptions", "get_backend"]
