"""OpenVINO's int8: NNCF post-training quantization of the ONNX model.

NNCF inserts QuantizeLinear/DequantizeLinear pairs (per-channel weights, activation ranges
calibrated on samples, SmoothQuant and bias correction for transformers) into the ONNX graph
itself; OpenVINO folds the pairs into int8 kernels when it compiles the model. The artifact
therefore stays an ONNX file any OpenVINO can load.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Sequence

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common

from kiln.errors import KilnError


def _with_transposed_weights_folded(model: ir.Model) -> ir.Model:
    """`model`, or a copy of it in which each MatMul weight that is a Transpose of an
    initializer (gpt2's lm_head reads its tied embedding so) is an initializer of its own.
    NNCF's SmoothQuant, part of the TRANSFORMER preset, takes such a MatMul for a weighted one,
    then finds no weight tensor by that name and fails ("'NoneType' object has no attribute
    'shape'"). Costs a transposed copy of each such weight (gpt2: 154 MB); the copy shares
    every other tensor with `model`, which is left as it is."""
    if not any(_transposed_initializer(node) for node in model.graph):
        return model
    work = model.clone()
    folded: dict[str, ir.Value] = {}
    for node in list(work.graph):
        transpose = _transposed_initializer(node)
        if transpose is None:
            continue
        weight = node.inputs[1]
        if weight.name not in folded:
            perm = transpose.attributes.get_ints("perm", None)
            array = np.transpose(transpose.inputs[0].const_value.numpy(), perm)
            value = ir.Value(name=f"{weight.name}_folded", const_value=ir.tensor(array))
            work.graph.register_initializer(value)
            folded[weight.name] = value
        node.replace_input_with(1, folded[weight.name])
    ir.passes.common.RemoveUnusedNodesPass()(work)
    return work


def _transposed_initializer(node: ir.Node) -> ir.Node | None:
    """The Transpose of an initializer that `node`, a MatMul, reads as its weight, if any."""
    weight = node.inputs[1] if node.op_type == "MatMul" and len(node.inputs) > 1 else None
    transpose = weight.producer() if weight is not None else None
    if transpose is None or transpose.op_type != "Transpose":
        return None
    source = transpose.inputs[0]
    if source is None or source.const_value is None or not source.is_initializer():
        return None
    return transpose


def quantize_nncf_int8(
    model: ir.Model,
    calibration: Sequence[dict],
    exclude: Sequence[str] = (),
    transformer: bool = False,
) -> ir.Model:
    """Static int8 for OpenVINO; nodes named in `exclude` stay fp32."""
    try:
        import nncf
    except ImportError:
        raise KilnError("OpenVINO int8 needs NNCF: pip install nncf.") from None
    proto = ir.serde.serialize_model(
        _with_transposed_weights_folded(model) if transformer else model
    )
    nncf_log = logging.getLogger("nncf")
    level = nncf_log.level
    nncf_log.setLevel(logging.ERROR)  # advice on every call
    # NNCF draws its progress bars on stdout, which must stay clean for --json.
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            quantized = nncf.quantize(
                proto,
                nncf.Dataset(list(calibration)),
                subset_size=len(calibration),
                model_type=nncf.ModelType.TRANSFORMER if transformer else None,
                ignored_scope=nncf.IgnoredScope(names=list(exclude), validate=False),
            )
    except Exception as exc:  # NNCF raises bare errors on graphs it cannot read
        raise KilnError(f"NNCF int8 quantization failed: {exc}") from None
    finally:
        nncf_log.setLevel(level)
    return ir.serde.deserialize_model(quantized)
