"""`kiln.compress.compress`: a trained-or-not PyTorch model and a dataset in; per method (QAT,
structured pruning, distillation, their combination) a compiled, verified artifact with its
parameters, FLOPs, P50 and held-out accuracy; the fastest one within the accuracy budget
written to `output`.

Decisions (which pruning level, which artifact to keep) are made on the validation split; the
reported accuracy is the test split's, which nothing was tuned on.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from kiln.artifact import check_destination
from kiln.compress import artifact as art
from kiln.compress.checks import check_data
from kiln.compress.data import Dataset
from kiln.compress.distill import builtin_student, distill, distillation_loss
from kiln.compress.loading import call
from kiln.compress.qat import qat
from kiln.compress.train import Recipe, accuracy, fit
from kiln.errors import KilnError
from kiln.home import replace_directory
from kiln.timing import interleave, round_p50_ms

METHODS = ("qat", "prune", "distill", "all")
METRICS = ("accuracy",)
LEVELS = (0.75, 0.5, 0.25)  # pruning levels tried, most aggressive first, when none is given
FINE_TUNE = 0.5  # pruned models are fine-tuned for this fraction of the training recipe
# A student starts from scratch, so it trains for longer than the teacher did (it is several
# times cheaper per epoch); at 1× the digits CNN's student reached 86.7 %, at 5× 99.4 %.
DISTILL_EPOCHS = 4.0
Say = Callable[[str], None]


@dataclass
class Row:
    """One method's artifact and what it costs. Accuracies are fractions in [0, 1]."""

    method: str
    precision: str
    accuracy: float  # on the held-out test split, by the compiled artifact
    val_accuracy: float  # by the PyTorch model; what budget decisions use
    params: int
    flops: int  # matrix-product FLOPs at `batch`
    artifact: str | None  # None once a temporary workdir is gone (see `compress`)
    p50_ms: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass
class Result:
    model: str
    data: str
    batch: int
    metric: str
    max_drop: float
    rows: list[Row]
    chosen: str | None = None  # the method whose artifact went to `output`
    output: str | None = None
    skipped: dict[str, str] = field(default_factory=dict)  # method → why (time, no student)
    note: str | None = None  # why `chosen` is what it is, when that may surprise

    def row(self, method: str) -> Row:
        return next(r for r in self.rows if r.method == method)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["methods"] = {r.method: asdict(r) for r in self.rows}
        del data["rows"]
        return data


@dataclass
class _Run:
    """What every step shares: data, budget, where artifacts go, how to report."""

    data: Dataset
    recipe: Recipe
    max_drop: float
    workdir: Path
    say: Say
    deadline: float | None
    baseline_val: float = 0.0

    def tick(self, what: str) -> Callable[[int, int], None]:
        return lambda done, total: self.say(f"{what}: epoch {done}/{total}")

    def over_time(self) -> bool:
        return self.deadline is not None and time.monotonic() > self.deadline


def compress(
    model: nn.Module | Callable[[], nn.Module],
    data: Dataset | Callable[[], Dataset],
    output: str | os.PathLike | None = None,
    *,
    method: str = "all",
    metric: str = "accuracy",
    max_drop: float = 0.01,
    time_budget: float | None = None,
    amount: float | None = None,
    importance: str = "taylor",
    student: nn.Module | Callable[[], nn.Module] | None = None,
    train: bool = True,
    recipe: Recipe | None = None,
    workdir: str | os.PathLike | None = None,
    rounds: int = 5,
    runs: int = 10,
    force: bool = False,
    progress: Say | None = None,
) -> Result:
    """Compress `model` (a module or a factory; trained first on `data` when `train`) with
    `method` and compile each result into a verified artifact.

    `max_drop`: the most test accuracy (a fraction, 0.01 = 1 point) a method may lose against
    the fp32 model (also post-training int8's guard); `amount`: the fraction of channels,
    heads, neurons pruned (None: the most of 0.75, 0.5, 0.25 within `max_drop` on
    validation); `time_budget` (seconds): stop training where it is and skip the methods not
    started when it runs out; `workdir`: keep
    every method's artifact there (default: a temporary directory, removed, and the rows'
    `artifact` paths then None but the one copied to `output`). The fastest artifact within
    `max_drop`, the uncompressed fp32 one included, is copied to `output`. `method="all"`
    skips distillation, saying why, when there is no `student` and no built-in one. Raises
    KilnError, writing nothing and before any training, for a factory or loader that cannot
    be called without arguments or returns the wrong thing, a model or student that does not
    export or take the data, and later for a pruning budget no level meets."""
    say = progress or (lambda _m: None)
    _check_choices(method, metric, max_drop, amount)
    if output is not None:
        check_destination(Path(output), force)
    deadline = time.monotonic() + time_budget if time_budget else None
    if not isinstance(data, Dataset):
        data = call(data, "data loader", Dataset, DATASET)
    if not isinstance(model, nn.Module):
        model = call(model, "model factory", nn.Module, MODULE)
    module: nn.Module = model
    check_data(module, data)
    art.export(module, data.val.x[: art.BATCH])  # fails before training, not after
    small, no_student = _student(module, student, method, data)
    scratch = Path(tempfile.mkdtemp(prefix="kiln-compress-")) if workdir is None else None
    root = Path(workdir) if workdir is not None else scratch
    root.mkdir(parents=True, exist_ok=True)
    run = _Run(data, recipe or Recipe(), max_drop, root, say, deadline)
    try:
        result = _compress(module, run, method, amount, importance, small, train)
        if no_student:
            result.skipped["distill"] = no_student
        result.model, result.metric = type(module).__name__, metric
        _time_rows(result, run, rounds, runs)
        if output is not None:
            _write_output(result, Path(output), force)
        if scratch is not None:  # every path the result names must outlive this call
            for row in result.rows:
                row.artifact = result.output if row.method == result.chosen else None
        return result
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


MODULE = "a torch.nn.Module"
DATASET = "a kiln.compress.data.Dataset (train/val/test splits of inputs and labels)"


def _check_choices(method: str, metric: str, max_drop: float, amount: float | None) -> None:
    if method not in METHODS:
        raise KilnError(f"unknown method '{method}'; use one of {', '.join(METHODS)}.")
    if metric not in METRICS:
        raise KilnError(f"unknown metric '{metric}'; compress measures {', '.join(METRICS)}.")
    if not 0 <= max_drop < 1:
        raise KilnError(f"--max-drop {max_drop} is a fraction: use a value in [0, 1), e.g. 0.01.")
    if amount is not None and not 0 < amount < 1:
        raise KilnError(f"--amount {amount}: prune a fraction in (0, 1), e.g. 0.5.")


def _compress(
    module: nn.Module,
    run: _Run,
    method: str,
    amount: float | None,
    importance: str,
    student: nn.Module | None,
    train: bool,
) -> Result:
    data = run.data
    if train:
        fit(module, data, run.recipe, tick=run.tick("training fp32"), deadline=run.deadline)
    module.eval()
    run.baseline_val = accuracy(module, data.val)
    rows = [_row(run, "fp32", module, "fp32")]
    result = Result(type(module).__name__, data.name, art.BATCH, "accuracy", run.max_drop, rows)
    wanted = ("qat", "prune", "distill", "combined") if method == "all" else (method,)
    pruned = None
    for step in wanted:
        if run.over_time():
            result.skipped[step] = "the --time budget ran out before it started"
            continue
        if step == "qat":
            rows.append(_row(run, "int8-ptq", module, "int8"))
            rows.append(_row(run, "qat", _qat(module, run), "int8"))
        elif step == "prune":
            pruned, detail = _prune_within_budget(module, run, amount, importance)
            rows.append(_row(run, "prune", pruned, "fp32", detail))
        elif step == "distill":
            if student is None:  # method "all" without a student: `compress` says why
                continue
            longer = run.recipe.scaled(DISTILL_EPOCHS)
            distill(module, student, data, longer, run.tick("distilling"), run.deadline)
            rows.append(_row(run, "distill", student, "fp32"))
        else:
            rows.append(_row(run, "combined", _combined(module, run, amount, importance), "int8"))
    return result


def _qat(module: nn.Module, run: _Run) -> nn.Module:
    return qat(module, run.data, run.recipe, run.tick("quantization-aware training"), run.deadline)


def _student(
    teacher: nn.Module, student: Any, method: str, data: Dataset
) -> tuple[nn.Module | None, str | None]:
    """The student distillation trains, checked before any training (it takes the data and
    exports), or None and why when `method` is "all" and there is none to be had."""
    if method not in ("distill", "all"):
        return None, None
    if student is None:
        made = builtin_student(teacher)
        if made is None:
            why = (
                f"no built-in student for {type(teacher).__name__}: give one with --student "
                "module:factory (Python: student=)"
            )
            if method == "all":
                return None, why
            raise KilnError(f"--method distill: {why}. Nothing was trained or written.")
    elif isinstance(student, nn.Module):
        made = student
    else:
        made = call(student, "student factory", nn.Module, MODULE)
    try:
        check_data(made, data)
        art.export(made, data.val.x[: art.BATCH])
    except KilnError as exc:
        raise KilnError(f"the student: {exc}") from None
    return made, None


def _prune_within_budget(
    module: nn.Module, run: _Run, amount: float | None, importance: str
) -> tuple[nn.Module, dict[str, Any]]:
    """The pruned and fine-tuned model at `amount`, or at the most aggressive level whose
    validation accuracy stays within the budget; KilnError when no level does."""
    tried: list[str] = []
    for level in (amount,) if amount is not None else LEVELS:
        run.say(f"pruning {level:.0%} ({importance})")
        report = prune_step(module, run.data, level, importance)
        tuned = fit(
            report.model, run.data, run.recipe.scaled(FINE_TUNE),
            tick=run.tick(f"fine-tuning the {level:.0%}-pruned model"), deadline=run.deadline,
        )  # fmt: skip
        drop = run.baseline_val - accuracy(tuned, run.data.val)
        if drop <= run.max_drop or amount is not None:  # a level asked for is kept as is
            return tuned, {"amount": level, "importance": importance, "val_drop": drop}
        tried.append(f"{level:.0%} loses {drop * 100:.1f} pt")
    raise KilnError(
        f"no pruning level meets --max-drop {run.max_drop:g} ({run.max_drop * 100:g} pt of "
        f"validation accuracy): {'; '.join(tried)}. Nothing was written; allow a larger "
        "--max-drop or prune less (--amount)."
    )


def prune_step(module: nn.Module, data: Dataset, amount: float, importance: str) -> Any:
    """kiln.compress.prune on `module` (a pruned copy and its report)."""
    from kiln.compress.data import batches
    from kiln.compress.prune import prune

    return prune(
        module, amount, importance=importance, data=batches(data.train, 64, shuffle=True),
        targets=_targets(module),
    )  # fmt: skip


def _targets(module: nn.Module) -> tuple[str, ...]:
    """Heads and FFN neurons in a transformer (its residual width stays); channels in a CNN."""
    from kiln.compress.prune_graph import is_attention_block

    if any(is_attention_block(m) for m in module.modules()):
        return ("heads", "neurons")
    return ("channels", "neurons")


def _combined(module: nn.Module, run: _Run, amount: float | None, importance: str) -> nn.Module:
    """prune → distill (the pruned model learns from the unpruned teacher) → QAT."""
    level = amount if amount is not None else 0.5
    run.say(f"combined: pruning {level:.0%}")
    pruned = prune_step(module, run.data, level, importance).model
    fit(
        pruned, run.data, run.recipe.scaled(FINE_TUNE), distillation_loss(module),
        tick=run.tick("combined: distilling into the pruned model"), deadline=run.deadline,
    )  # fmt: skip
    return _qat(pruned, run)


def _row(
    run: _Run, method: str, module: nn.Module, precision: str, detail: dict | None = None
) -> Row:
    run.say(f"{method}: compiling and verifying the {precision} artifact")
    built = art.build(
        module, run.workdir / f"{method}.kiln", run.data, precision=precision,
        max_drop=run.max_drop, say=run.say,
    )  # fmt: skip
    run.say(f"{method}: measuring accuracy on the test split")
    return Row(
        method=method,
        precision=precision,
        accuracy=art.artifact_accuracy(built.artifact, run.data.test),
        val_accuracy=accuracy(module, run.data.val),
        params=art.params(module),
        flops=art.flops(built.exported),
        artifact=str(built.artifact.path),
        detail=detail or {},
    )


def _time_rows(result: Result, run: _Run, rounds: int, runs: int) -> None:
    """P50 at the stated batch, every artifact interleaved in the same rounds (noisy host)."""
    run.say(f"timing {len(result.rows)} artifacts at batch {art.BATCH}, interleaved")
    feeds, runners = run.data.test.x[: art.BATCH].numpy(), {}
    for row in result.rows:
        session = art.session_at(row.artifact)
        name = session.input_names[0]
        runners[row.method] = lambda s=session, n=name: s.run(None, {n: feeds})
    samples = interleave(runners, rounds=rounds, runs=runs)
    for row in result.rows:
        row.p50_ms = round_p50_ms(samples[row.method])


def fastest_within_budget(result: Result) -> Row:
    """The timed row with the lowest P50 among those within `max_drop` of fp32's test
    accuracy, fp32's own included: a compression that made the model slower is no gain
    (int8 kernels can lose to fp32 ones on a small model)."""
    fp32 = result.row("fp32")
    within = [r for r in result.rows if fp32.accuracy - r.accuracy <= result.max_drop]
    return min(within, key=lambda r: r.p50_ms if r.p50_ms is not None else float("inf"))


def _write_output(result: Result, output: Path, force: bool) -> None:
    """The fastest artifact within the budget (on test accuracy) copied to `output`."""
    best = fastest_within_budget(result)
    if best.method == "fp32" and result.rows[1:]:
        result.note = _why_fp32(result, best)
    if output.exists():
        check_destination(output, force)
    replace_directory(output, lambda tmp: shutil.copytree(best.artifact, tmp, dirs_exist_ok=True))
    result.chosen, result.output = best.method, str(output)


def _why_fp32(result: Result, fp32: Row) -> str:
    """Why no compressed artifact went to `output`: each was slower or lost too much."""
    reasons = []
    for row in result.rows[1:]:
        drop = (fp32.accuracy - row.accuracy) * 100
        if drop > result.max_drop * 100:
            reasons.append(f"{row.method} loses {drop:.1f} pt")
        else:
            reasons.append(f"{row.method} is slower, {_ms(row)} against {_ms(fp32)}")
    return (
        f"fp32 was chosen: no compressed model is faster within --max-drop "
        f"{result.max_drop:g} ({'; '.join(reasons)})"
    )


def _ms(row: Row) -> str:
    return f"{row.p50_ms:.2f} ms" if row.p50_ms is not None else "untimed"
