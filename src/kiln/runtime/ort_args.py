"""ONNX Runtime's own session arguments, as its users pass them: `providers`,
`sess_options` (an onnxruntime.SessionOptions) and `run_options` (an onnxruntime.RunOptions),
mapped onto Kiln's engine and engine options, or refused with what to do instead.

They are read duck-typed (attributes and enum names): only kiln.backends imports onnxruntime.
A SessionOptions field left at ONNX Runtime's default keeps the setting Kiln would use (an
artifact's recorded one): the fields a user set are the ones that say what they want.
"""

from __future__ import annotations

import warnings
from typing import Any

from kiln.errors import KilnError

# ONNX Runtime's execution providers that name an engine Kiln runs.
PROVIDERS = {"CPUExecutionProvider": "ort", "OpenVINOExecutionProvider": "openvino"}

_LEVELS = {
    "ORT_DISABLE_ALL": "disable",
    "ORT_ENABLE_BASIC": "basic",
    "ORT_ENABLE_EXTENDED": "extended",
    "ORT_ENABLE_ALL": "all",
}
_MODES = {"ORT_SEQUENTIAL": "sequential", "ORT_PARALLEL": "parallel"}
# SessionOptions field -> (ONNX Runtime's default, Kiln's option per engine, value mapping).
_MAPPED: dict[str, tuple[Any, dict[str, str], dict[str, str] | None]] = {
    "intra_op_num_threads": (0, {"ort": "intra_op_threads", "openvino": "inference_num_threads"},
                             None),
    "inter_op_num_threads": (0, {"ort": "inter_op_threads"}, None),
    "graph_optimization_level": ("ORT_ENABLE_ALL", {"ort": "optimization"}, _LEVELS),
    "execution_mode": ("ORT_SEQUENTIAL", {"ort": "execution_mode"}, _MODES),
    "enable_cpu_mem_arena": (True, {"ort": "memory_arena"}, None),
    "enable_mem_pattern": (True, {"ort": "memory_pattern"}, None),
}  # fmt: skip
# Fields Kiln cannot honour when set, and what to use instead.
_REFUSED = {
    "enable_profiling": (False, "profile with `kiln profile MODEL` (per-op times, per kernel)"),
    "optimized_model_filepath": ("", "write an optimized model with `kiln optimize MODEL -o`"),
    "use_deterministic_compute": (False, "it has no Kiln equivalent; drop it"),
}


def backend_of(providers: Any, backend: str | None, where: str) -> str | None:
    """The engine `providers` asks for: as ONNX Runtime does, the first one it can run (the
    ones before it are skipped with a warning); KilnError when none is an engine Kiln has,
    or when it contradicts `backend`."""
    if providers is None:
        return backend
    if isinstance(providers, str) or not isinstance(providers, list | tuple):
        raise KilnError(
            f"{where}: providers must be a list, e.g. ['CPUExecutionProvider'], got {providers!r}."
        )
    skipped = []
    for entry in providers:
        name, options = entry if isinstance(entry, tuple) and len(entry) == 2 else (entry, None)
        if name not in PROVIDERS:
            skipped.append(str(name))
            continue
        if options:
            raise KilnError(
                f"{where}: provider options {options!r} for {name} are not taken; Kiln sets the "
                "engine's options itself: pass options={...} (see Session.options)."
            )
        chosen = PROVIDERS[name]
        if backend not in (None, chosen):
            raise KilnError(
                f"{where}: providers ask for {name} (backend '{chosen}') but backend='{backend}' "
                "was given; give one of them."
            )
        if skipped:
            warnings.warn(
                f"{where}: providers {skipped} are not engines Kiln runs; using {name}.",
                stacklevel=3,
            )
        return chosen
    raise KilnError(
        f"{where}: none of the providers {[str(p) for p in providers]} is an engine Kiln runs; "
        f"use one of {sorted(PROVIDERS)}."
    )


def session_overrides(sess_options: Any, backend: str, where: str) -> dict[str, Any]:
    """Kiln engine options for the fields of an onnxruntime.SessionOptions that differ from
    ONNX Runtime's defaults; KilnError for one Kiln cannot honour on `backend`."""
    if sess_options is None:
        return {}
    if not hasattr(sess_options, "intra_op_num_threads"):
        raise KilnError(
            f"{where}: sess_options must be an onnxruntime.SessionOptions, got "
            f"{type(sess_options).__name__}; for Kiln's own settings pass options={{...}}."
        )
    overrides: dict[str, Any] = {}
    for field, (default, names, values) in _MAPPED.items():
        value = getattr(sess_options, field, default)
        value = getattr(value, "name", value)  # an ONNX Runtime enum, by its name
        if value == default:
            continue
        if backend not in names:
            raise KilnError(
                f"{where}: sess_options.{field} = {value} has no equivalent on backend "
                f"'{backend}'; leave it at its default ({default})."
            )
        if values is not None and value not in values:
            raise KilnError(
                f"{where}: sess_options.{field} = {value} is not supported; use one of "
                f"{sorted(values)}."
            )
        overrides[names[backend]] = values[value] if values is not None else value
    for field, (default, instead) in _REFUSED.items():
        if getattr(sess_options, field, default) != default:
            raise KilnError(f"{where}: sess_options.{field} is not supported: {instead}.")
    return overrides


def check_run_options(run_options: Any, where: str) -> None:
    """run(None, feeds, run_options): accepted as ONNX Runtime's; its logging fields have no
    effect (Kiln logs through `logging`), and `terminate`, as in ONNX Runtime, refuses the run."""
    if not hasattr(run_options, "terminate"):
        raise KilnError(
            f"{where}: run_options must be an onnxruntime.RunOptions or None, got "
            f"{type(run_options).__name__}."
        )
    if run_options.terminate:
        raise KilnError(f"{where}: run_options.terminate is set; the run was not started.")
