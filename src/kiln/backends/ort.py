"""ONNX Runtime CPU backend, with every session option that matters under Kiln's control."""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir
import onnxruntime as ort

from kiln.errors import KilnError

LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}
# Serialized protobufs cannot exceed 2 GiB; above this, models go through a file with
# external data.
_INLINE_LIMIT = 1 << 30


@dataclass
class OrtOptions:
    """Session options. 0 threads means ONNX Runtime's own default."""

    optimization: str = "all"
    intra_op_threads: int = 0
    inter_op_threads: int = 0
    spinning: bool = True
    memory_arena: bool = True
    memory_pattern: bool = True
    extra: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> OrtOptions:
        return cls(**data)

    def session_options(self) -> ort.SessionOptions:
        if self.optimization not in LEVELS:
            raise KilnError(
                f"unknown ORT optimization level '{self.optimization}'; "
                f"use one of {', '.join(LEVELS)}."
            )
        so = ort.SessionOptions()
        so.graph_optimization_level = LEVELS[self.optimization]
        so.intra_op_num_threads = self.intra_op_threads
        so.inter_op_num_threads = self.inter_op_threads
        so.enable_cpu_mem_arena = self.memory_arena
        so.enable_mem_pattern = self.memory_pattern
        so.log_severity_level = 3
        so.add_session_config_entry(
            "session.intra_op.allow_spinning", "1" if self.spinning else "0"
        )
        for key, value in self.extra.items():
            so.add_session_config_entry(key, value)
        return so


class OrtExecutable:
    """An ONNX Runtime InferenceSession behind Kiln's Executable contract."""

    def __init__(self, session: ort.InferenceSession, options: OrtOptions) -> None:
        self.session = session
        self.options = options
        self.input_names = [i.name for i in session.get_inputs()]
        self.output_names = [o.name for o in session.get_outputs()]

    def run(
        self, feeds: dict[str, np.ndarray], output_names: list[str] | None = None
    ) -> list[np.ndarray]:
        try:
            return self.session.run(output_names, feeds)
        except (ort.capi.onnxruntime_pybind11_state.InvalidArgument, ValueError) as exc:
            raise KilnError(f"invalid inputs: {_first_line(exc)}") from None

    def profile(self, feeds: dict[str, np.ndarray], runs: int) -> list[dict[str, Any]]:
        """Per-kernel records from ONNX Runtime's profiler, one list over `runs` runs."""
        raise KilnError("per-op profiling of ONNX Runtime arrives with `kiln profile`.")


class OrtBackend:
    name = "ort"

    def available(self) -> bool:
        return True

    def describe(self) -> dict[str, str]:
        return {
            "engine": "onnxruntime",
            "version": ort.__version__,
            "providers": ",".join(ort.get_available_providers()),
        }

    def compile(self, model: ir.Model | str, options: OrtOptions | None = None) -> OrtExecutable:
        options = options or OrtOptions()
        so = options.session_options()
        try:
            if isinstance(model, str | os.PathLike):
                session = _session(str(model), so)
            else:
                session = _session_from_ir(model, so)
        except KilnError:
            raise
        except Exception as exc:  # ORT raises many pybind types; all mean "cannot run this"
            raise KilnError(f"ONNX Runtime cannot load the model: {_explain(exc)}") from None
        return OrtExecutable(session, options)


def _session(path_or_bytes: str | bytes, so: ort.SessionOptions) -> ort.InferenceSession:
    return ort.InferenceSession(path_or_bytes, so, providers=["CPUExecutionProvider"])


def _session_from_ir(model: ir.Model, so: ort.SessionOptions) -> ort.InferenceSession:
    tensors = [v.const_value for v in model.graph.initializers.values() if v.const_value]
    size = sum(t.nbytes for t in tensors)
    # Weights still in an external file would be resolved against ORT's working directory
    # when the model comes as bytes, so such models also go through a file.
    external = any(isinstance(t, ir.ExternalTensor) for t in tensors)
    if size < _INLINE_LIMIT and not external:
        return _session(ir.serde.serialize_model(model).SerializeToString(), so)
    with tempfile.TemporaryDirectory(prefix="kiln-ort-") as tmp:
        path = Path(tmp) / "model.onnx"
        ir.save(model, path, external_data="model.onnx.data")
        return _session(str(path), so)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _explain(exc: BaseException) -> str:
    text = _first_line(exc)
    marker = "Could not find an implementation for "
    if marker in text:
        return "no kernel for " + text.split(marker, 1)[1] + " (op unsupported on CPU)"
    return text


def options_summary(options: OrtOptions) -> str:
    return json.dumps(options.to_json(), sort_keys=True)
