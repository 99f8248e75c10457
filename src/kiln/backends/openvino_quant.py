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

import onnx_ir as ir

from kiln.errors import KilnError


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
    nncf_log = logging.getLogger("nncf")
    level = nncf_log.level
    nncf_log.setLevel(logging.ERROR)  # advice on every call
    # NNCF draws its progress bars on stdout, which must stay clean for --json.
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            quantized = nncf.quantize(
                ir.serde.serialize_model(model),
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
