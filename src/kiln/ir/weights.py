"""How many bytes of weights a model holds: the size most memory decisions are scaled by."""

from __future__ import annotations

import onnx_ir as ir


def weight_bytes(model: ir.Model) -> int:
    """Bytes of the top graph's initializers with a value (lazy external tensors by their
    declared size, without reading them)."""
    values = model.graph.initializers.values()
    return sum(v.const_value.nbytes for v in values if v.const_value is not None)
