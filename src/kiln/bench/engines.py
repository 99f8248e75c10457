"""The engines `kiln bench` can put side by side, each a zero-argument run function."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from kiln.backends import get_backend
from kiln.backends.ort import OrtOptions
from kiln.errors import KilnError

ENGINES = {
    "ort": "ONNX Runtime, ORT_ENABLE_ALL, fp32 (its default)",
    "ort-basic": "ONNX Runtime, ORT_ENABLE_BASIC, fp32",
    "ort-transformers": "onnxruntime.transformers.optimizer (opt_level 0), then ORT_ENABLE_ALL",
}


def parse_engines(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    for name in names:
        if name not in ENGINES:
            raise KilnError(
                f"unknown engine '{name}' in --against; choose from {', '.join(ENGINES)}."
            )
    return names


def engine_runner(
    name: str, original: ir.Model, feeds: dict[str, np.ndarray]
) -> Callable[[], object]:
    """Compile the original model for a baseline engine and return a run-once function."""
    ort = get_backend("ort")
    if name == "ort":
        exe = ort.compile(original, OrtOptions(optimization="all"))
    elif name == "ort-basic":
        exe = ort.compile(original, OrtOptions(optimization="basic"))
    elif name == "ort-transformers":
        from kiln.backends.ort_transformers import transformers_optimize

        proto = transformers_optimize(original)
        exe = ort.compile(ir.serde.deserialize_model(proto), OrtOptions(optimization="all"))
    else:
        raise KilnError(f"unknown engine '{name}'.")
    return lambda: exe.run(feeds)
