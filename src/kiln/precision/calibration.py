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

from kiln.ir.inputs import read_calibration, synthesize
from kiln.ir.ladder import Guess

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
    fit: Guess,
) -> Calibration:
    """`inputs` are the user's reference inputs (`inputs_name`: where they came from); `fit`
    the shapes and scalar values synthetic samples take."""
    samples = read_calibration(calib, model) if calib else None
    found = _found(calib, samples)
    if not static:  # nothing to calibrate: the user's samples all judge the accuracy
        if samples is None:
            return Calibration()
        use = (
            "not used: --inputs judge the accuracy"
            if inputs is not None
            else "all judge the accuracy"
        )
        return Calibration(
            held_out=None if inputs is not None else samples,
            note={
                "source": calib,
                "summary": f"{found}; dynamic int8 calibrates nothing, so they {use}",
            },
        )
    if samples:
        if inputs is not None or len(samples) < 2:
            summary = f"{found}, all used to calibrate"
            return Calibration(
                samples, None, {"source": calib, "method": method, "summary": summary}
            )
        held = max(1, len(samples) // 4)
        summary = f"{found}: {len(samples) - held} calibrate, {held} held out to judge accuracy"
        note = {"source": calib, "method": method, "held_out": held, "summary": summary}
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
    synthetic = [
        synthesize(model, seed=100 + i, shapes=fit.shapes, scalars=fit.scalars)
        for i in range(SYNTHETIC_SETS)
    ]
    note = {
        "source": "synthetic",
        "method": method,
        "warning": "calibrated on synthetic inputs: accuracy on real data is unproven; "
        "give real samples with --calib",
    }
    return Calibration(synthetic, None, note)


def _found(calib: str | None, samples: list[Feeds] | None) -> str:
    """How many samples --calib held, and how they were read (a file whose arrays have the
    model's input rank is one sample; one more leading axis makes it a stack)."""
    if not samples:
        return ""
    count = len(samples)
    how = (
        ""
        if count > 1
        else " (arrays of the inputs' own rank are one sample; stack samples on a new first axis)"
    )
    return f"--calib {calib}: {count} sample{'s' if count != 1 else ''}{how}"
