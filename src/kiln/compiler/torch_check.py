"""The artifact against the model's own framework: a PyTorch module's outputs on its example
inputs, besides the exported graph's (which every compile is verified against).

Two checks, both at Kiln's fp32 tolerance (max abs ≤ 1e-4 · scale) or, below fp32, the
precision's budget: the exported ONNX graph against PyTorch (the export itself may drift, and
no pass is to blame for that), and the compiled artifact against PyTorch, where the export's
own deviation counts as noise the artifact is not blamed for. Both are recorded under the
manifest's `verification.torch`; either failing stops the compile with one line naming it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kiln.backends import get_backend
from kiln.compiler.candidate import CompileResult
from kiln.compiler.reference import reference_executable
from kiln.errors import KilnError
from kiln.verify import OutputCheck, Verification, _is_float, compare, cosine

EXAMPLE = "example_inputs"


def check_against_framework(result: CompileResult) -> None:
    """Record (in `result.verification.torch`) how the artifact and the exported graph match
    the framework's own outputs; raise KilnError, nothing written, when either does not."""
    example = result.loaded.example
    if example is None or result.verification is None or not result.ok:
        return
    source, feeds, expected = result.loaded.source, example.feeds, example.outputs
    names = [v.name for v in result.loaded.model.graph.outputs]
    exported = _exported_outputs(result)
    export = compare(names, [expected], [exported], EXAMPLE)
    noise = {o.name: o.max_abs for o in export.outputs}
    executable = get_backend(result.backend).compile(result.model, result.options)
    compiled = executable.run(feeds)
    artifact = compare(
        names, [expected], [compiled], EXAMPLE, result.precision, noise=noise,
        budget=result.config.budget(),
    )  # fmt: skip
    result.verification.torch = _record(example.framework, export, artifact, expected, compiled)
    if not export.ok:
        raise KilnError(
            f"{source}: the exported ONNX graph does not match the PyTorch module on the example "
            f"inputs ({export.summary()}): the export itself drifts, before any Kiln pass. "
            "Nothing was written; check the module exports faithfully (torch.onnx.export)."
        )
    if not artifact.ok:
        raise KilnError(
            f"{source}: the artifact does not match the PyTorch module on the example inputs "
            f"({artifact.summary()}), although the exported graph does. Nothing was written."
        )


def _exported_outputs(result: CompileResult) -> list[np.ndarray]:
    """The exported graph's outputs on the example: the reference run's when verification ran
    on the example itself, else one run of its own."""
    example = result.loaded.example
    assert example is not None
    if result.feeds and result.feeds[0] is example.feeds and result.reference:
        return result.reference[0]
    return reference_executable(result.loaded.model).run(example.feeds)


def _record(
    framework: str,
    export: Verification,
    artifact: Verification,
    expected: list[np.ndarray],
    compiled: list[Any],
) -> dict[str, Any]:
    """Per output: the artifact's max abs error and cosine against the framework, the bound it
    was held to, and the exported graph's own max abs error."""
    rows = []
    for check, drift, ref, new in zip(
        artifact.outputs, export.outputs, expected, compiled, strict=True
    ):
        rows.append({
            "name": check.name, "max_abs": check.max_abs, "cosine": _cosine(check, ref, new),
            "bound": check.bound, "ok": check.ok, "export_max_abs": drift.max_abs,
        })  # fmt: skip
    return {
        "framework": framework,
        "inputs": EXAMPLE,
        "ok": export.ok and artifact.ok,
        "export_ok": export.ok,
        "outputs": rows,
    }


def _cosine(check: OutputCheck, ref: np.ndarray, new: Any) -> float | None:
    if check.cosine is not None:
        return check.cosine
    floating = isinstance(new, np.ndarray) and _is_float(ref.dtype) and ref.shape == new.shape
    return cosine(ref, new) if floating else None
