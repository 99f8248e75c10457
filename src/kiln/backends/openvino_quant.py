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
from typing import Any

import numpy as np
import onnx_ir as ir
import onnx_ir.passes.common

from kiln.errors import KilnError


def _with_transposed_weights_folded(proto: Any) -> Any:
    """The model with each MatMul weight that is a Transpose of an initializer (gpt2's lm_head
    reads its tied embedding so) made an initializer of its own. NNCF's SmoothQuant, part of
    the TRANSFORMER preset, takes such a MatMul for a weighted one, then finds no weight
    tensor by that name and fails ("'NoneType' object has no attribute 'shape'"). Costs a
    transposed copy of each such weight (gpt2: 154 MB); the model itself is left as it is."""
    work = ir.serde.deserialize_model(proto)
    folded: dict[str, ir.Value] = {}
    for node in list(work.graph):
        weight = node.inputs[1] if node.op_type == "MatMul" and len(node.inputs) > 1 else None
        transpose = weight.producer() if weight is not None else None
        if transpose is None or transpose.op_type != "Transpose":
            continue
        source = transpose.inputs[0]
        if source is None or source.const_value is None or not source.is_initializer():
            continue
        if weight.name not in folded:
            perm = transpose.attributes.get_ints("perm", None)
            array = np.transpose(source.const_value.numpy(), perm)
            value = ir.Value(name=f"{weight.name}_folded", const_value=ir.tensor(array))
            work.graph.register_initializer(value)
            folded[weight.name] = value
        node.replace_input_with(1, folded[weight.name])
    if not folded:
        return proto
    ir.passes.common.RemoveUnusedNodesPass()(work)
    return ir.serde.serialize_model(work)


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
    proto = ir.serde.serialize_model(model)
    if transformer:
        proto = _with_transposed_weights_folded(proto)
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
    return gather_before_dequantize(ir.serde.deserialize_model(quantized))


def gather_before_dequantize(model: ir.Model) -> ir.Model:
    """Each embedding table NNCF quantized, read as int8: `Gather(DequantizeLinear(q, s, zp),
    ids)` becomes `(Gather(q, ids) − Gather(zp, ids)) × Gather(s, ids)`. OpenVINO folds a
    DequantizeLinear of a constant into an fp32 constant, so bert-base's 22 MiB int8 word
    table was held as 89 MiB of fp32; gathered first, only the rows a request reads are
    dequantized. Exact: the same integers times the same scales. A table something other
    than a row Gather reads (a tied output head) is left as it is. Changes `model` in place."""
    for dq in [n for n in model.graph if _is_row_table(n)]:
        for gather, _ in list(dq.outputs[0].uses()):
            tape = ir.tape.Tape()
            out = _dequantized_rows(tape, dq, gather)
            model.graph.insert_before(gather, tape.nodes)
            name = gather.outputs[0].name
            ir.convenience.replace_all_uses_with(gather.outputs[0], out, replace_graph_outputs=True)
            model.graph.remove(gather, safe=True)
            out.name = name  # a graph output keeps its name
        model.graph.remove(dq, safe=True)
    return model


def _dequantized_rows(tape: ir.tape.Tape, dq: ir.Node, gather: ir.Node) -> ir.Value:
    """`DequantizeLinear(q, s, zp, axis=0)[ids]` as the rows gathered, then dequantized; the
    nodes named after the Gather they replace (a profile then still says which table)."""
    q, scale, zero = (*dq.inputs, None)[:3]
    ids, to, at = gather.inputs[1], {"to": scale.dtype}, f"{gather.name}.int8"

    def op(kind: str, inputs: list, role: str, **attributes: object) -> ir.Value:
        return tape.op(kind, inputs, attributes=attributes or None, name=f"{at}.{role}")

    last = op("Constant", [], "last_axis", value=ir.tensor(np.array([-1])))
    rows = op("Cast", [op("Gather", [q, ids], "rows")], "rows_cast", **to)
    if zero is not None:
        zeros = op("Cast", [op("Gather", [zero, ids], "zero_points")], "zero_points_cast", **to)
        rows = op("Sub", [rows, op("Unsqueeze", [zeros, last], "zero_points_axis")], "centred")
    scales = op("Unsqueeze", [op("Gather", [scale, ids], "scales"), last], "scales_axis")
    return op("Mul", [rows, scales], "dequantized")


def _is_row_table(node: ir.Node) -> bool:
    """A per-row (axis 0) DequantizeLinear of a constant table that only row Gathers read."""
    if node.op_type != "DequantizeLinear" or node.inputs[0] is None:
        return False
    table, scale = node.inputs[0], node.inputs[1]
    if table.const_value is None or scale is None or scale.const_value is None:
        return False
    if scale.shape is None or len(scale.shape) != 1 or node.attributes.get_int("axis", 1) != 0:
        return False
    uses = list(node.outputs[0].uses())
    return bool(uses) and all(
        user.op_type == "Gather" and index == 0 and user.attributes.get_int("axis", 0) == 0
        for user, index in uses
    )
