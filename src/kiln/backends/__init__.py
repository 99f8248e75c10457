"""Engines that run models: the only package that imports onnxruntime or openvino."""

from __future__ import annotations

from typing import Any

from kiln.backends.base import Backend, Executable, KernelRecord, Profile
from kiln.backends.openvino import OpenVinoBackend, OpenVinoOptions
from kiln.backends.ort import OrtBackend, OrtOptions
from kiln.backends.spin_policy import join_company, leave_company, share_process
from kiln.errors import KilnError

BACKENDS: dict[str, type[Backend]] = {"ort": OrtBackend, "openvino": OpenVinoBackend}
OPTIONS: dict[str, type] = {"ort": OrtOptions, "openvino": OpenVinoOptions}


def get_backend(name: str) -> Backend:
    if name not in BACKENDS:
        raise KilnError(f"unknown backend '{name}'; available: {', '.join(sorted(BACKENDS))}.")
    backend = BACKENDS[name]()
    if not backend.available():
        raise KilnError(f"backend '{name}' is not installed.")
    return backend


def default_options(name: str, precision: str = "fp32") -> Any:
    """Each engine's settings for a precision: fp32 is forced where an engine would pick
    something else (OpenVINO runs bf16 by default on CPUs that have it)."""
    if name == "openvino":
        if precision == "int8":
            # As OpenVINO itself does: what stays out of int8 runs in bf16 where the CPU can.
            from kiln.backends.openvino import cpu_runs_bf16

            return OpenVinoOptions(inference_precision="bf16" if cpu_runs_bf16() else "f32")
        return OpenVinoOptions(inference_precision="bf16" if precision == "bf16" else "f32")
    return OrtOptions()


def options_from_json(name: str, data: dict[str, Any]) -> Any:
    return OPTIONS[name].from_json(data)


def import_tools(*tools: str) -> None:
    """Import the engines' own model tools ahead of use: "ort-quantization",
    "ort-transformers", "nncf" (a memory baseline counts the library, not its first call)."""
    if "ort-quantization" in tools:
        import onnxruntime.quantization  # noqa: F401
    if "ort-transformers" in tools:
        import onnxruntime.transformers.optimizer  # noqa: F401
    if "nncf" in tools:
        import nncf  # noqa: F401


def available_backends() -> list[str]:
    return [name for name, cls in BACKENDS.items() if cls().available()]


__all__ = [
    "BACKENDS",
    "Backend",
    "Executable",
    "KernelRecord",
    "OpenVinoBackend",
    "OpenVinoOptions",
    "OrtBackend",
    "OrtOptions",
    "Profile",
    "available_backends",
    "default_options",
    "get_backend",
    "import_tools",
    "join_company",
    "leave_company",
    "options_from_json",
    "share_process",
]
