"""Numerical verification of a compiled model against the original.

fp32 tolerance: max |ref - new| ≤ 1e-4 · scale, where scale is the largest |ref| of that
output (floored at 1e-3 so near-zero outputs are not held to an impossible bound), or 4× the
engine's own noise — how far the *original* model moves between the reference settings and the
artifact's engine settings — when that is larger: a compiled model is not blamed for rounding
the engine itself introduces (e.g. a sigmoid head whose outputs are all near zero). Integer and
boolean outputs must match exactly.

Lower precisions (bf16, int8) are judged by a task metric instead: the cosine similarity of
each floating output to the fp32 reference, per sample, must be at least 0.99 for every sample
(max-abs is still reported).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

FP32_TOLERANCE = 1e-4
MIN_COSINE = 0.99
SCALE_FLOOR = 1e-3
NOISE_FACTOR = 4.0


@dataclass
class OutputCheck:
    name: str
    max_abs: float
    max_rel: float
    scale: float
    bound: float
    ok: bool
    engine_noise: float = 0.0
    cosine: float | None = None  # lower precisions are judged by it


@dataclass
class Verification:
    ok: bool
    precision: str
    inputs: str  # "synthesized" or the user's file
    outputs: list[OutputCheck]
    error: str | None = None  # the compiled model could not run at all

    def to_json(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        if self.error:
            return self.error
        failing = [o for o in self.outputs if not o.ok] or self.outputs
        if self.precision != "fp32":
            worst = min(failing, key=lambda o: o.cosine if o.cosine is not None else 1.0)
            return f"output '{worst.name}' cosine {worst.cosine:.4f}, needs ≥ {MIN_COSINE}"
        worst = max(failing, key=lambda o: o.max_abs / max(o.bound, 1e-30))
        return f"output '{worst.name}' max abs error {worst.max_abs:.3g}, bound {worst.bound:.3g}"


def max_abs_diff(ref: np.ndarray, new: np.ndarray) -> float:
    if ref.shape != new.shape or not np.issubdtype(ref.dtype, np.floating):
        return 0.0
    diff = np.abs(ref.astype(np.float64) - new.astype(np.float64))
    diff = diff[np.isfinite(diff)]
    return float(diff.max()) if diff.size else 0.0


def check_output(
    name: str, ref: np.ndarray, new: np.ndarray, tol: float, noise: float = 0.0
) -> OutputCheck:
    if ref.shape != new.shape:
        return OutputCheck(name, float("inf"), float("inf"), 0.0, 0.0, False)
    if not np.issubdtype(ref.dtype, np.floating):
        same = bool(np.array_equal(ref, new))
        return OutputCheck(name, 0.0 if same else float("inf"), 0.0, 0.0, 0.0, same)
    ref64, new64 = ref.astype(np.float64), new.astype(np.float64)
    both_nan = np.isnan(ref64) & np.isnan(new64)
    diff = np.where(both_nan, 0.0, np.abs(ref64 - new64))
    diff = np.where(np.isnan(diff), np.inf, diff)
    finite = np.isfinite(ref64)
    scale = max(float(np.abs(ref64[finite]).max()) if finite.any() else 0.0, SCALE_FLOOR)
    max_abs = float(diff.max()) if diff.size else 0.0
    rel = diff / np.maximum(np.abs(ref64), scale * 1e-3)
    max_rel = float(rel.max()) if rel.size else 0.0
    bound = max(tol * scale, NOISE_FACTOR * noise)
    return OutputCheck(name, max_abs, max_rel, scale, bound, max_abs <= bound, noise)


def cosine(ref: np.ndarray, new: np.ndarray) -> float:
    """The worst per-sample cosine similarity (samples along the first axis): a batch-wide
    cosine would let one badly served sample hide behind the others."""
    rows = ref.shape[0] if ref.ndim >= 2 and ref.shape[0] > 0 else 1
    a = ref.astype(np.float64).reshape(rows, -1)
    b = new.astype(np.float64).reshape(rows, -1)
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("nan")
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    dots = (a * b).sum(axis=1)
    same = np.all(a == b, axis=1)
    values = np.where(norms > 0, dots / np.where(norms > 0, norms, 1.0), same.astype(float))
    return float(values.min())


def check_output_cosine(name: str, ref: np.ndarray, new: np.ndarray) -> OutputCheck:
    check = check_output(name, ref, new, FP32_TOLERANCE)
    if ref.shape != new.shape or not np.issubdtype(ref.dtype, np.floating):
        return check
    value = cosine(ref, new)
    check.cosine, check.bound, check.ok = value, MIN_COSINE, value >= MIN_COSINE
    return check


def compare(
    names: list[str],
    reference: list[list[np.ndarray]],
    candidate: list[list[np.ndarray]],
    inputs: str,
    precision: str = "fp32",
    tol: float = FP32_TOLERANCE,
    noise: dict[str, float] | None = None,
) -> Verification:
    """Compare outputs over several input sets; each output keeps its worst case. `noise`
    is the engine's own per-output deviation on the original (see the module docstring)."""
    worst: dict[str, OutputCheck] = {}
    for ref_set, new_set in zip(reference, candidate, strict=True):
        for name, ref, new in zip(names, ref_set, new_set, strict=True):
            if precision == "fp32":
                check = check_output(name, ref, new, tol, (noise or {}).get(name, 0.0))
            else:
                check = check_output_cosine(name, ref, new)
            prior = worst.get(name)
            if prior is None or (not check.ok, check.max_abs) > (not prior.ok, prior.max_abs):
                worst[name] = check
    outputs = [worst[n] for n in names]
    return Verification(all(o.ok for o in outputs), precision, inputs, outputs)
