"""ONNX Runtime's own offline transformers optimizer, as a baseline engine for `kiln bench`."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

import onnx
import onnx_ir as ir

from kiln.errors import KilnError


def guess_model_type(model: ir.Model) -> str:
    """The optimizer's model_type: from the zoo name, else 'bert' (its generic encoder path)."""
    name = model.metadata_props.get("kiln.zoo", "") or (model.graph.name or "")
    for kind in ("gpt2", "vit", "bert"):
        if kind in name.lower():
            return kind
    return "bert"


def transformers_optimize(model: ir.Model, model_type: str | None = None) -> onnx.ModelProto:
    """Fuse with onnxruntime.transformers.optimizer (heads and hidden size auto-detected)."""
    from onnxruntime.transformers.optimizer import optimize_model

    logging.getLogger("onnxruntime.transformers").setLevel(logging.ERROR)
    kind = model_type or guess_model_type(model)
    with tempfile.TemporaryDirectory(prefix="kiln-ortx-") as tmp:
        path = Path(tmp) / "model.onnx"
        ir.save(model, path, external_data="model.onnx.data")
        try:
            # opt_level=0: Python fusions only. Its ORT pre-pass imports torch just to read a
            # version; ORT_ENABLE_ALL at session creation does that pre-pass's work anyway.
            optimized = optimize_model(
                str(path), model_type=kind, num_heads=0, hidden_size=0, opt_level=0
            )
        except Exception as exc:  # the optimizer raises bare errors on graphs it cannot read
            raise KilnError(f"ONNX Runtime's transformers optimizer failed: {exc}") from None
        proto = optimized.model
        onnx.load_external_data_for_model(proto, tmp)
        return proto
