"""Which samples calibrate a static int8 model and which judge its accuracy.

The user's `--calib` samples calibrate; without `--inputs` a quarter of them is held out for
the accuracy guard. Without `--calib`, Kiln calibrates on synthetic inputs and says so: the
note goes into the manifest and the table, since accuracy on real data is then unproven.

A calibration run exposes the model's activations at once (NNCF and ONNX Runtime's
calibrators read every quantized tensor of a sample), so synthetic samples are made no longer
than the memory available allows: where every intermediate tensor at the model's dims would
exceed a quarter of it (bert-base-4k at 4,096 tokens: 43 GiB, its S² scores 768 MiB a tensor),
the dims past the batch axis are halved until they fit, and the note says so. The artifact
is still verified at its own dims: a range calibrated short that does not hold there is what
the accuracy guard catches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir

from kiln.cost.memory_plan import plan_memory
from kiln.errors import KilnError
from kiln.ir.inputs import (
    bind_dims,
    default_dims,
    model_inputs,
    named_dims,
    read_calibration,
    synthesize,
)
from kiln.ir.ladder import Guess

Feeds = dict[str, np.ndarray]
SYNTHETIC_SETS = 8
MEMORY_SHARE = 0.25  # of the memory available: what one calibration run's activations may hold
SHORTEST_DIM = 64  # a dim is not halved below this


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
    shapes, shortened = _fitting_memory(model, fit.shapes)
    synthetic = [
        synthesize(model, seed=100 + i, shapes=shapes, scalars=fit.scalars)
        for i in range(SYNTHETIC_SETS)
    ]
    note = {
        "source": "synthetic",
        "method": method,
        "warning": "calibrated on synthetic inputs: accuracy on real data is unproven; "
        "give real samples with --calib",
    }
    if shortened:
        note["shortened"] = shortened
    return Calibration(synthetic, None, note)


def _fitting_memory(
    model: ir.Model, shapes: dict[str, tuple[int, ...]]
) -> tuple[dict[str, tuple[int, ...]], str]:
    """`shapes`, with the dims past the batch axis halved while a calibration run's
    activations would not fit in MEMORY_SHARE of the memory available; and what was done, in
    words ("" when nothing was)."""
    import psutil

    dims = bind_dims(model, default_dims(model), shapes)
    budget = psutil.virtual_memory().available * MEMORY_SHARE
    needed = _activation_bytes(model, dims)
    if needed is None or needed <= budget:
        return shapes, ""
    first = needed
    inner = _inner_dims(model)
    fitted = dict(dims)
    while needed is not None and needed > budget:
        halved = {d: v // 2 for d, v in fitted.items() if d in inner and v // 2 >= SHORTEST_DIM}
        if not halved:
            break
        fitted |= halved
        needed = _activation_bytes(model, fitted)
    if fitted == dims:
        return shapes, ""
    halved = {d: v for d, v in fitted.items() if v != dims[d]}
    at = ", ".join(f"{d}={v}" for d, v in halved.items())
    was = ", ".join(f"{d}={dims[d]}" for d in halved)
    said = (
        f"synthetic samples made at {at} (not {was}): at {was} a calibration run holds "
        f"{first / 2**30:.1f} GiB of activations, over a quarter of the "
        f"{budget / MEMORY_SHARE / 2**30:.1f} GiB available; the artifact is verified at {was}"
    )
    return _with_dims(model, shapes, halved), said


def _with_dims(
    model: ir.Model, shapes: dict[str, tuple[int, ...]], dims: dict[str, int]
) -> dict[str, tuple[int, ...]]:
    """`shapes` (by input or by dim name) with the named `dims` set, wherever they appear."""
    inputs = model_inputs(model)
    out = {}
    for key, shape in shapes.items():
        if key in inputs:
            new = list(shape)
            for axis, name in named_dims(inputs[key]):
                if name in dims and axis < len(new):
                    new[axis] = dims[name]
            out[key] = tuple(new)
        else:
            out[key] = shape
    return out | {d: (v,) for d, v in dims.items()}


def _activation_bytes(model: ir.Model, dims: dict[str, int]) -> int | None:
    """Every intermediate tensor at `dims`, none reused: what exposing them all holds."""
    try:
        return plan_memory(model, dims).no_reuse_bytes
    except KilnError:  # shapes Kiln cannot infer: nothing to go by, nothing changed
        return None


def _inner_dims(model: ir.Model) -> set[str]:
    """Named dims found past axis 0 of an input (a sequence, an image side): the batch is
    the samples' own count and is left alone."""
    return {
        name
        for value in model_inputs(model).values()
        for axis, name in named_dims(value)
        if axis > 0
    }


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
