"""Numerical verification of a compiled model against the original.

fp32 tolerance: max |ref - new| ≤ 1e-4 · scale, where scale is the largest |ref| of that
output (floored at 1e-3 so near-zero outputs are not held to an impossible bound), or 4× the
engine's own noise — how far the *original* model moves between the reference settings and the
artifact's engine settings — when that is larger: a compiled model is not blamed for rounding
the engine itself introduces (e.g. a sigmoid head whose outputs are all near zero). Integer,
boolean and string outputs must match exactly; a sequence output is checked element by element.

Non-finite values: a position where both models give NaN, or both the same infinity, is equal
(fp16 overflow, empty-set reductions, the -inf logits behind an attention mask). A NaN or
infinity on one side only, or +inf against -inf, fails whatever the precision or metric, and the
summary says how many values and of which kind. The scale comes from the reference's finite
values only, so -inf logits do not make the bound infinite.

Lower precisions (bf16, int8, int4) are judged by a task metric and a budget instead
(`Budget`): the metric's score on every reference input set may fall at most `max_drop`
(relative, default 1 %) below its score on the fp32 outputs themselves. Built-in metrics, each
the worst over the floating outputs and, within one, over samples (the first axis):
``cosine`` (≥ 0.99 by default), ``top1`` (argmax agreement over the last axis, ≥ 99 %) and
``max-abs`` (1 − max|ref − new| / scale, so at most 1 % of the output's scale); or a user's
``module:function(outputs_ref, outputs_new) -> float`` where higher is better. Cosine and
max-abs are reported for every output whatever the metric. The metrics ignore positions that
are non-finite alike on both sides (cosine, max-abs) and score a non-finite mismatch as a
failure (cosine NaN, max-abs -inf, a top-1 disagreement).
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
    problem: str | None = None  # what is wrong beyond the size of the error, in words


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
    note: str | None = None  # how the budget was read, where that is not the obvious way
    # A PyTorch source: the artifact and the exported graph against PyTorch's own outputs
    # (kiln.compiler.torch_check).
    torch: dict | None = None

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
        named = [o for o in failing if o.problem and not o.ok]
        if named:  # NaN / inf / shape / exact-value mismatches say what they are
            return f"output '{named[0].name}': {named[0].problem}"
        if self.metric is not None:
            where = ""
            if self.metric == "cosine":
                worst = min(failing, key=_cosine_rank)
                where = f"output '{worst.name}' "
            return f"{where}{self.metric} {self.score:.4f}, needs ≥ {self.threshold:.4f}"
        worst = max(failing, key=lambda o: o.max_abs / max(o.bound, 1e-30))
        return f"output '{worst.name}' max abs error {worst.max_abs:.3g}, bound {worst.bound:.3g}"


def _cosine_rank(check: OutputCheck) -> tuple[bool, float]:
    """Sorts the worst first: a named problem, then the lowest cosine (NaN lowest of all)."""
    value = 1.0 if check.cosine is None else check.cosine
    return check.problem is None, float("-inf") if np.isnan(value) else value


def _is_float(dtype: np.dtype) -> bool:
    """numpy's floating dtypes and ml_dtypes' (bfloat16, float8, float4), which numpy does not
    count as floating."""
    return np.issubdtype(dtype, np.floating) or "float" in np.dtype(dtype).name


_KINDS = ("NaN", "+inf", "-inf", "finite")


def _kind(values: np.ndarray) -> np.ndarray:
    """Per position, an index into _KINDS."""
    return np.select([np.isnan(values), values == np.inf, values == -np.inf], [0, 1, 2], 3)


def _alike(ref64: np.ndarray, new64: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(finite on both sides, non-finite alike on both sides: both NaN or the same inf)."""
    finite = np.isfinite(ref64) & np.isfinite(new64)
    same = (np.isnan(ref64) & np.isnan(new64)) | (np.isinf(ref64) & (ref64 == new64))
    return finite, same


def _nonfinite_problem(ref64: np.ndarray, new64: np.ndarray, odd: np.ndarray) -> str | None:
    """E.g. "3 values are NaN in the compiled model but finite in the original"."""
    if not odd.any():
        return None
    codes = _kind(new64[odd]) * len(_KINDS) + _kind(ref64[odd])
    parts = []
    found = zip(*np.unique(codes, return_counts=True), strict=True)
    for code, count in sorted(found, key=lambda f: (-f[1], f[0])):  # the most common first
        new_kind, ref_kind = _KINDS[code // len(_KINDS)], _KINDS[code % len(_KINDS)]
        values = "1 value is" if count == 1 else f"{count} values are"
        parts.append(f"{values} {new_kind} in the compiled model but {ref_kind} in the original")
    return "; ".join(parts)


def _layout_problem(ref: np.ndarray, new: np.ndarray) -> str | None:
    if ref.shape != new.shape:
        return (
            f"shape {list(new.shape)} in the compiled model but {list(ref.shape)} in the original"
        )
    if _is_float(ref.dtype) != _is_float(new.dtype):
        return f"dtype {new.dtype} in the compiled model but {ref.dtype} in the original"
    return None


def _sequence_problem(ref: object, new: object) -> str | None:
    """Why a sequence output (a list of tensors) cannot be compared element by element."""
    if not (isinstance(ref, list) and isinstance(new, list)):
        what = {True: "a sequence", False: "a tensor"}
        return (
            f"{what[isinstance(new, list)]} in the compiled model but "
            f"{what[isinstance(ref, list)]} in the original"
        )
    if len(ref) != len(new):
        return (
            f"a sequence of {len(new)} tensors in the compiled model but {len(ref)} in the original"
        )
    return None


def max_abs_diff(ref: np.ndarray | list, new: np.ndarray | list) -> float:
    """The largest |ref − new| of a floating output (0 for others and for outputs of other
    shapes); positions non-finite alike on both sides are equal, any other non-finite
    difference is inf. A sequence: the largest over its elements."""
    if isinstance(ref, list) or isinstance(new, list):
        if _sequence_problem(ref, new):
            return 0.0
        return max((max_abs_diff(r, n) for r, n in zip(ref, new, strict=True)), default=0.0)
    if _layout_problem(ref, new) or not _is_float(ref.dtype):
        return 0.0
    ref64, new64 = ref.astype(np.float64), new.astype(np.float64)
    finite, same = _alike(ref64, new64)
    if not (finite | same).all():
        return float("inf")
    diff = np.abs(ref64[finite] - new64[finite])
    return float(diff.max()) if diff.size else 0.0


def check_output(
    name: str,
    ref: np.ndarray | list,
    new: np.ndarray | list,
    tol: float,
    noise: float = 0.0,
) -> OutputCheck:
    inf = float("inf")
    if isinstance(ref, list) or isinstance(new, list):
        return _check_sequence(name, ref, new, tol, noise)
    problem = _layout_problem(ref, new)
    if problem:
        return OutputCheck(name, inf, inf, 0.0, 0.0, False, problem=problem)
    if not _is_float(ref.dtype):
        unequal = np.asarray(ref != new)  # text against numbers compares as one scalar
        differ = int(np.count_nonzero(unequal)) if unequal.shape == ref.shape else ref.size
        if not differ:
            return OutputCheck(name, 0.0, 0.0, 0.0, 0.0, True)
        kind = "string" if ref.dtype.kind in "OUS" else str(ref.dtype)
        problem = f"{differ} of {ref.size} values differ; {kind} outputs must match exactly"
        return OutputCheck(name, inf, 0.0, 0.0, 0.0, False, problem=problem)
    ref64, new64 = ref.astype(np.float64), new.astype(np.float64)
    finite, same = _alike(ref64, new64)
    odd = ~(finite | same)
    problem = _nonfinite_problem(ref64, new64, odd)
    reference = np.abs(ref64[np.isfinite(ref64)])
    scale = max(float(reference.max()) if reference.size else 0.0, SCALE_FLOOR)
    diff = np.abs(ref64[finite] - new64[finite])
    rel = diff / np.maximum(np.abs(ref64[finite]), scale * 1e-3)
    max_abs = inf if problem else float(diff.max()) if diff.size else 0.0
    max_rel = inf if problem else float(rel.max()) if rel.size else 0.0
    noise = noise if np.isfinite(noise) else 0.0  # the engine's own NaN says nothing of rounding
    bound = max(tol * scale, NOISE_FACTOR * noise)
    ok = problem is None and max_abs <= bound
    return OutputCheck(name, max_abs, max_rel, scale, bound, ok, noise, problem=problem)


def _check_sequence(name: str, ref: object, new: object, tol: float, noise: float) -> OutputCheck:
    """The worst element's check; a sequence of another length (or none) fails."""
    inf = float("inf")
    problem = _sequence_problem(ref, new)
    if problem:
        return OutputCheck(name, inf, inf, 0.0, 0.0, False, problem=problem)
    assert isinstance(ref, list) and isinstance(new, list)
    checks = [check_output(name, r, n, tol, noise) for r, n in zip(ref, new, strict=True)]
    if not checks:
        return OutputCheck(name, 0.0, 0.0, SCALE_FLOOR, tol * SCALE_FLOOR, True, noise)
    index, worst = max(
        enumerate(checks), key=lambda c: (not c[1].ok, c[1].max_abs / max(c[1].bound, 1e-30))
    )
    if worst.problem:
        worst.problem = f"element {index}: {worst.problem}"
    return worst


def cosine(ref: np.ndarray, new: np.ndarray) -> float:
    """The worst per-sample cosine similarity (samples along the first axis): a batch-wide
    cosine would let one badly served sample hide behind the others. Positions non-finite
    alike on both sides (masked -inf logits) are left out; any other non-finite value makes it
    NaN, which fails every bar."""
    rows = ref.shape[0] if ref.ndim >= 2 and ref.shape[0] > 0 else 1
    a = ref.astype(np.float64).reshape(rows, -1)
    b = new.astype(np.float64).reshape(rows, -1)
    finite, same = _alike(a, b)
    if not (finite | same).all():
        return float("nan")
    a, b = np.where(finite, a, 0.0), np.where(finite, b, 0.0)
    norms = np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    dots = (a * b).sum(axis=1)
    equal = np.all(a == b, axis=1)
    values = np.where(norms > 0, dots / np.where(norms > 0, norms, 1.0), equal.astype(float))
    return float(values.min())


def top1(ref: np.ndarray, new: np.ndarray) -> float:
    """How often the argmax over the last axis agrees (scores per position, e.g. classes); a
    position whose scores are non-finite differently on the two sides disagrees."""
    a, b = ref.astype(np.float64), new.astype(np.float64)
    finite, same = _alike(a, b)
    if a.ndim == 0 or a.shape[-1] < 2:
        agree = (np.sign(np.where(finite, a, 0.0)) == np.sign(np.where(finite, b, 0.0))) & (
            finite | same
        )
        return 1.0 if agree.all() else 0.0
    agree = (a.argmax(axis=-1) == b.argmax(axis=-1)) & (finite | same).all(axis=-1)
    return float(agree.mean()) if agree.size else 1.0


def relative_max_abs(ref: np.ndarray, new: np.ndarray) -> float:
    """1 − max|ref − new| / scale: 1 is exact, 0.99 is off by 1 % of the output's scale (the
    largest finite |ref|). Positions non-finite alike are equal; any other non-finite
    difference scores -inf."""
    ref64, new64 = ref.astype(np.float64), new.astype(np.float64)
    finite, same = _alike(ref64, new64)
    if not (finite | same).all():
        return float("-inf")
    reference = np.abs(ref64[np.isfinite(ref64)])
    scale = max(float(reference.max()) if reference.size else 0.0, SCALE_FLOOR)
    diff = np.abs(ref64[finite] - new64[finite])
    return 1.0 - (float(diff.max()) if diff.size else 0.0) / scale


def _tensor_pairs(ref: np.ndarray | list, new: np.ndarray | list) -> list | None:
    """One output's (reference, candidate) tensors, a sequence's element by element; None when
    they cannot be paired (another shape, or another sequence length)."""
    if isinstance(ref, list) or isinstance(new, list):
        if _sequence_problem(ref, new):
            return None
        pairs = [_tensor_pairs(r, n) for r, n in zip(ref, new, strict=True)]
        return None if any(p is None for p in pairs) else [x for p in pairs for x in p]
    return None if ref.shape != new.shape else [(ref, new)]


def _worst(scores: list[float]) -> float:
    """The lowest score; NaN (an undefined score) is lower than any."""
    if any(np.isnan(s) for s in scores):
        return float("nan")
    return min(scores, default=1.0)


def nonfinite_mismatch(ref: np.ndarray | list, new: np.ndarray | list) -> str | None:
    """Words for the positions of a floating output that are NaN or inf on one side only (or
    +inf against -inf), e.g. "2 values are NaN in the compiled model but finite in the
    original"; None when there are none (or the outputs cannot be paired)."""
    for index, (r, n) in enumerate(_tensor_pairs(ref, new) or []):
        if not (_is_float(r.dtype) and _is_float(n.dtype)):
            continue
        r64, n64 = r.astype(np.float64), n.astype(np.float64)
        finite, same = _alike(r64, n64)
        problem = _nonfinite_problem(r64, n64, ~(finite | same))
        if problem:
            return f"element {index}: {problem}" if isinstance(ref, list) else problem
    return None


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
            return self._user_score(ref, new)
        each = BUILTIN_METRICS[self.metric]
        pairs = [_tensor_pairs(r, n) for r, n in zip(ref, new, strict=True)]
        if any(p is None for p in pairs):
            return float("-inf")
        return _worst(
            [each(r, n) for p in pairs for r, n in p if _is_float(r.dtype) and _is_float(n.dtype)]
        )

    def threshold(self, ref: list[np.ndarray]) -> float:
        best = self.score(ref, ref)  # a user metric need not score 1 on identical outputs
        return best - self.max_drop * self.scale(best)

    @staticmethod
    def scale(best: float) -> float:
        """What --max-drop is a fraction of: the fp32 score, or, where that is 0 (a metric
        such as -max error), the metric's own unit — a relative drop from 0 allows nothing."""
        return abs(best) if best != 0 else 1.0

    def _user_score(self, ref: list[np.ndarray], new: list[np.ndarray]) -> float:
        try:
            value = self.function(ref, new)  # type: ignore[misc]
        except Exception as exc:  # the user's code: any error is theirs to see, in one line
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise KilnError(
                f"metric '{self.metric}' raised {type(exc).__name__}"
                f"{': ' + first if first else ''}; it is called as f(outputs_ref, outputs_new) "
                "with two lists of numpy arrays and must return a float."
            ) from None
        try:
            return float(value)
        except (TypeError, ValueError):
            raise KilnError(
                f"metric '{self.metric}' returned {type(value).__name__}, not a number; it "
                "must return a float (higher is better)."
            ) from None


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
    """Below fp32: max-abs for the record and cosine for floating tensors. Exact equality is
    not asked (integer outputs follow the task metric), but shapes and non-finite values must
    still agree."""
    check = check_output(name, ref, new, FP32_TOLERANCE)
    if _tensor_pairs(ref, new) is None:
        return check  # another shape or sequence length: the problem stands
    if isinstance(ref, list):
        check.problem = nonfinite_mismatch(ref, new)
        return check
    if not (_is_float(ref.dtype) and _is_float(new.dtype)):
        check.problem = _layout_problem(ref, new)
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
            if prior is None or _cosine_rank(check) < _cosine_rank(prior):
                worst[name] = check
    outputs = [worst[n] for n in names]
    for o in outputs:  # per-output marks follow the budget, not a fixed cosine bar
        if budget.metric == "cosine" and o.cosine is not None:
            o.bound = 1.0 - budget.max_drop
            o.ok = o.cosine >= o.bound
        else:
            o.ok = ok
        if o.problem:  # NaN or inf where the original has none fails whatever the metric says
            o.ok = ok = False
    note = None
    if any(budget.score(r, r) == 0 for r in reference):
        note = (
            f"the original scores 0 on {budget.metric}: --max-drop {budget.max_drop:g} is read "
            "on the metric's own scale (an absolute drop), since a relative one allows nothing"
        )
    return Verification(
        ok, precision, inputs, outputs, None, budget.metric, worst_score, bar, note=note
    )
