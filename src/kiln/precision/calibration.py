"""Which samples calibrate a static int8 model and which judge its accuracy.

The user's `--calib` samples calibrate; without `--inputs` a quarter of them is held out for
the accuracy guard. Without `--calib`, Kiln calibrates on synthetic inputs and says so: the
note goes into the manifest and the table, since accuracy on real data is then unproven.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir

from kiln.ir.inputs import default_dims, read_calibration, synthesize

Feeds = dict[str, np.ndarray]
SYNTHETIC_SETS = 8


@dataclass
class Calibration:
    """Samples to calibrate on (None: the scheme needs none), samples held out to judge the
    accuracy (None: the reference inputs judge), and the manifest's note."""

    samples: list[Feeds] | None = None
    held_out: list[Feeds] | None = None
    note: dict[str, Any] | None = field(default=None)


def calibration_for(
    model: ir.Model,
    static: bool,
    calib: str | None,
    method: str,
    inputs: Feeds | None,
    inputs_name: str | None,
    shapes: dict | None,
) -> Calibration:
    """`inputs` are the user's reference inputs (`inputs_name`: where they came from)."""
    samples = read_calibration(calib, model) if calib else None
    if not static:  # nothing to calibrate: the user's samples all judge the accuracy
        return Calibration(held_out=None if inputs is not None else samples)
    if samples:
        if inputs is not None or len(samples) < 2:
            return Calibration(samples, None, {"source": calib, "method": method})
        held = max(1, len(samples) // 4)
        note = {"source": calib, "method": method, "held_out": held}
        return Calibration(samples[:-held], samples[-held:], note)
    if inputs is not None:
        return Calibration(
            [inputs],
            None,
            {
                "source": inputs_name,
                "method": method,
                "warning": "calibrated on the verification inputs themselves; give separate "
                "samples with --calib",
            },
        )
    dims = default_dims(model)
    synthetic = [
        synthesize(model, dims, seed=100 + i, shapes=shapes) for i in range(SYNTHETIC_SETS)
    ]
    note = {
        "source": "synthetic",
        "method": method,
        "warning": "calibrated on synthetic inputs: accuracy on real data is unproven; "
        "give real samples with --calib",
    }
    return Calibration(synthetic, None, note)
