"""Numerical verification of a compiled model against the original.

fp32 tolerance: max |ref - new| ≤ 1e-4 · scale, where scale is the largest |ref| of that
output (floored at 1e-3 so near-zero outputs are not held to an impossible bound), or 4× the
engine's own noise — how far the *original* model moves between the reference settings and the
artifact's engine settings — when that is larger: a compiled model is not blamed for rounding
the engine itself introduces (e.g. a sigmoid head whose outputs are all near zero). Integer and
boolean outputs must match exactly.

Lower precisions (bf16, int8, int4) are judged by a task metric and a budget instead
(`Budget`): the metric's score on every reference input set may fall at most `max_drop`
(relative, default 1 %) below its score on the fp32 outputs themselves. Built-in metrics, each
the worst over the floating outputs and, within one, over samples (the first axis):
``cosine`` (≥ 0.99 by default), ``top1`` (argmax agreement over the last axis, ≥ 99 %) and
``max-abs`` (1 − max|ref − new| / scale, so at most 1 % of the output's scale); or a user's
``module:function(outputs_ref, outputs_new) -> float`` where higher is better. Cosine and
max-abs are reported for every output whatever the metric.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from kiln.errors import KilnError

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
    metric: str | None = None  # lower precisions: the task metric, its worst score, the bar
    score: float | None = None
    threshold: float | None = None

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Verification:
        outputs = [OutputCheck(**o) for o in data.get("outputs", [])]
        return cls(**{**data, "outputs": outputs})

    def summary(self) -> str:
        if self.error:
            return self.error
        failing = [o for o in self.outputs if not o.ok] or self.outputs
        if self.metric is not None:
            where = ""
            if self.metric == "cosine":
                worst = min(failing, key=lambda o: o.cosine if o.cosine is not None else 1.0)
                where = f"output '{worst.name}' "
            return f"{where}{self.metric} {self.score:.4f}, needs ≥ {self.threshold:.4f}"
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


def top1(ref: np.ndarray, new: np.ndarray) -> float:
    """How often the argmax over the last axis agrees (scores per position, e.g. classes)."""
    if ref.ndim == 0 or ref.shape[-1] < 2:
        return 1.0 if np.array_equal(np.sign(ref), np.sign(new)) else 0.0
    return float(np.mean(ref.argmax(axis=-1) == new.argmax(axis=-1)))


def relative_max_abs(ref: np.ndarray, new: np.ndarray) -> float:
    """1 − max|ref − new| / scale: 1 is exact, 0.99 is off by 1 % of the output's scale."""
    ref64, new64 = ref.astype(np.float64), new.astype(np.float64)
    if not (np.isfinite(ref64).all() and np.isfinite(new64).all()):
        return float("nan")
    scale = max(float(np.abs(ref64).max()) if ref64.size else 0.0, SCALE_FLOOR)
    return 1.0 - float(np.abs(ref64 - new64).max() if ref64.size else 0.0) / scale


BUILTIN_METRICS: dict[str, Callable[[np.ndarray, np.ndarray], float]] = {
    "cosine": cosine,
    "top1": top1,
    "max-abs": relative_max_abs,
}
UserMetric = Callable[[list[np.ndarray], list[np.ndarray]], float]


@dataclass(frozen=True)
class Budget:
    """A task metric (higher is better) and how far below its fp32 score it may fall."""

    metric: str = "cosine"
    max_drop: float = 0.01
    function: UserMetric | None = field(default=None, compare=False, repr=False)

    def score(self, ref: list[np.ndarray], new: list[np.ndarray]) -> float:
        """The metric on one input set's outputs (builtins: the worst floating output)."""
        if self.function is not None:
            return float(self.function(ref, new))
        each = BUILTIN_METRICS[self.metric]
        scores = [
            each(r, n)
            for r, n in zip(ref, new, strict=True)
            if np.issubdtype(r.dtype, np.floating) and r.shape == n.shape
        ]
        if any(r.shape != n.shape for r, n in zip(ref, new, strict=True)):
            return float("-inf")
        return min(scores, default=1.0)

    def threshold(self, ref: list[np.ndarray]) -> float:
        best = self.score(ref, ref)  # a user metric need not score 1 on identical outputs
        return best - self.max_drop * abs(best)


def budget_for(metric: str = "cosine", max_drop: float = 0.01) -> Budget:
    """A Budget from the CLI's words: a built-in metric's name, or module:function."""
    if not 0 <= max_drop < 1:
        raise KilnError(f"--max-drop {max_drop} is a fraction: use a value in [0, 1), e.g. 0.01.")
    if metric in BUILTIN_METRICS:
        return Budget(metric, max_drop)
    module_name, _, function_name = metric.partition(":")
    if not (module_name and function_name):
        raise KilnError(
            f"unknown metric '{metric}'; use {', '.join(BUILTIN_METRICS)} or "
            "module:function (a Python function (outputs_ref, outputs_new) -> float)."
        )
    try:
        function = getattr(importlib.import_module(module_name), function_name)
    except (ImportError, AttributeError) as exc:
        raise KilnError(f"metric '{metric}' cannot be loaded: {exc}.") from None
    if not callable(function):
        raise KilnError(f"metric '{metric}' is not a function.")
    return Budget(metric, max_drop, function)


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
    budget: Budget | None = None,
) -> Verification:
    """Compare outputs over several input sets; each output keeps its worst case. `noise`
    is the engine's own per-output deviation on the original (see the module docstring).
    Below fp32 the `budget` decides (default: cosine ≥ 0.99)."""
    if precision != "fp32":
        return _compare_metric(names, reference, candidate, inputs, precision, budget or Budget())
    worst: dict[str, OutputCheck] = {}
    for ref_set, new_set in zip(reference, candidate, strict=True):
        for name, ref, new in zip(names, ref_set, new_set, strict=True):
            check = check_output(name, ref, new, tol, (noise or {}).get(name, 0.0))
            prior = worst.get(name)
            if prior is None or (not check.ok, check.max_abs) > (not prior.ok, prior.max_abs):
                worst[name] = check
    outputs = [worst[n] for n in names]
    return Verification(all(o.ok for o in outputs), precision, inputs, outputs)


def _compare_metric(
    names: list[str],
    reference: list[list[np.ndarray]],
    candidate: list[list[np.ndarray]],
    inputs: str,
    precision: str,
    budget: Budget,
) -> Verification:
    worst: dict[str, OutputCheck] = {}
    ok, worst_score, bar = True, float("inf"), float("inf")
    for ref_set, new_set in zip(reference, candidate, strict=True):
        score, threshold = budget.score(ref_set, new_set), budget.threshold(ref_set)
        ok = ok and bool(score >= threshold)  # NaN fails
        if not score >= worst_score:
            worst_score, bar = score, threshold
        for name, ref, new in zip(names, ref_set, new_set, strict=True):
            check = check_output_cosine(name, ref, new)
            prior = worst.get(name)
            if prior is None or (check.cosine or 1.0) < (prior.cosine or 1.0):
                worst[name] = check
    outputs = [worst[n] for n in names]
    for o in outputs:  # per-output marks follow the budget, not a fixed cosine bar
        if budget.metric == "cosine" and o.cosine is not None:
            o.bound = 1.0 - budget.max_drop
            o.ok = o.cosine >= o.bound
        else:
            o.ok = ok
    return Verification(ok, precision, inputs, outputs, None, budget.metric, worst_score, bar)
