"""ONNX Runtime sessions on a large in-memory model whose weights still lie in their file.

A compile opens several sessions on one model (the reference, each candidate, the baselines it
is timed against), and ONNX Runtime reads a copy of the weights into each, so a compile's
peak grows with them to a multiple of the weights (benchmarks/compile_memory.py measures
it). Here every session uses the
weights on one memory map of their file (`SessionOptions.add_initializer` takes the buffer
without copying), so they are resident once, shared by every session. ONNX Runtime still
checks each external reference before it sees the override, so the model handed to it points
them at a sparse placeholder file of the right size in its own directory (it refuses paths
out of it, links included); nothing reads it. Prepacking is off on such sessions: a packed
copy per session is what sharing avoids.
"""

from __future__ import annotations

import os
import tempfile
import threading
import weakref
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

# Below this, a copy per session costs little and prepacked weights run faster.
SHARE_MAPPED_BYTES = 1 << 30
_PLACEHOLDER = "kiln-mapped-placeholder.bin"
# One read-only map per weights file, whatever tensor objects point into it: a pass that
# copies the model makes new ExternalTensors, and pages mapped twice count twice.
_MAPS: weakref.WeakValueDictionary[tuple[str, int], np.memmap] = weakref.WeakValueDictionary()
_MAPS_LOCK = threading.Lock()


def mapped_weights(model: ir.Model) -> dict[str, np.ndarray] | None:
    """The main graph's external initializers as arrays on the file's mapping, when they hold
    SHARE_MAPPED_BYTES or more and each has a plain numpy dtype; else None."""
    external = {
        name: value.const_value
        for name, value in model.graph.initializers.items()
        if isinstance(value.const_value, ir.ExternalTensor)
    }
    if sum(t.nbytes for t in external.values()) < SHARE_MAPPED_BYTES:
        return None
    if any(t.dtype.numpy().kind not in "biuf" for t in external.values()):
        return None  # bfloat16, float8, int4: no OrtValue from numpy
    return {name: _mapped(tensor) for name, tensor in external.items()}


def _mapped(tensor: ir.ExternalTensor) -> np.ndarray:
    """The tensor's bytes on the one map of its file (kept alive by the arrays using it)."""
    path = Path(tensor.path).resolve()
    key = (str(path), path.stat().st_mtime_ns)  # a rewritten file is mapped afresh
    with _MAPS_LOCK:
        whole = _MAPS.get(key)
        if whole is None:
            whole = np.memmap(path, dtype=np.uint8, mode="r")
            _MAPS[key] = whole
    start = tensor.offset or 0
    raw = whole[start : start + tensor.nbytes]
    return raw.view(tensor.dtype.numpy()).reshape(tensor.shape.numpy())


def session_on_mapped(
    model: ir.Model,
    so: ort.SessionOptions,
    arrays: dict[str, np.ndarray],
    disabled: tuple[str, ...] = (),
) -> ort.InferenceSession | None:
    """A session whose initializers named in `arrays` are those arrays; None when the model
    holds an external reference this cannot override (in a subgraph, say)."""
    proto = ir.serde.serialize_model(model)
    size = 0
    for tensor in proto.graph.initializer:
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        if tensor.name not in arrays:
            return None
        entries = {e.key: e for e in tensor.external_data}
        offset = int(entries["offset"].value) if "offset" in entries else 0
        size = max(size, offset + arrays[tensor.name].nbytes)
        entries["location"].value = _PLACEHOLDER
    if _has_external(proto.graph, top=True):
        return None
    values = {name: ort.OrtValue.ortvalue_from_numpy(a) for name, a in arrays.items()}
    for name, value in values.items():
        so.add_initializer(name, value)
    _no_prepacking(so)
    with tempfile.TemporaryDirectory(prefix="kiln-ort-") as tmp:
        path = Path(tmp) / "model.onnx"
        path.write_bytes(proto.SerializeToString())
        with (Path(tmp) / _PLACEHOLDER).open("wb") as placeholder:
            os.truncate(placeholder.fileno(), size)  # sparse: no disk, no memory
        session = ort.InferenceSession(
            str(path), so, providers=["CPUExecutionProvider"],
            disabled_optimizers=list(disabled) or None,
        )  # fmt: skip
    session._kiln_mapped = values  # the buffers live as long as the session
    return session


def _no_prepacking(so: ort.SessionOptions) -> None:
    key = "session.disable_prepacking"
    try:
        current = so.get_session_config_entry(key)
    except Exception:  # noqa: BLE001 (ORT raises its own type for a key not set)
        current = None
    if current != "1":  # setting it again over a value logs a warning
        so.add_session_config_entry(key, "1")


def _has_external(graph: onnx.GraphProto, top: bool) -> bool:
    """An external reference left anywhere but the main graph's overridden initializers."""
    if not top and any(t.data_location == onnx.TensorProto.EXTERNAL for t in graph.initializer):
        return True
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.t.data_location == onnx.TensorProto.EXTERNAL:
                return True
            subgraphs = [attribute.g] if attribute.HasField("g") else []
            if any(_has_external(g, top=False) for g in [*subgraphs, *attribute.graphs]):
                return True
    return False
