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
from kiln.compress.distill import distill, distillation_loss, smaller
from kiln.compress.qat import qat
from kiln.compress.train import Recipe, accuracy, fit
from kiln.errors import KilnError
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
    artifact: str
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
    skipped: dict[str, str] = field(default_factory=dict)  # method → why (time budget)

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
    every method's artifact there (default: a temporary directory, removed). The fastest
    artifact within `max_drop` is copied to `output`. Raises KilnError, writing nothing, for
    a model that does not export, data of the wrong shape, or a budget nothing meets."""
    say = progress or (lambda _m: None)
    _check_choices(method, metric, max_drop, amount)
    if output is not None:
        check_destination(Path(output), force)
    deadline = time.monotonic() + time_budget if time_budget else None
    data = data() if callable(data) and not isinstance(data, Dataset) else data
    module = model() if not isinstance(model, nn.Module) else model
    check_data(module, data)
    art.export(module, data.val.x[: art.BATCH])  # fails before training, not after
    scratch = Path(tempfile.mkdtemp(prefix="kiln-compress-")) if workdir is None else None
    root = Path(workdir) if workdir is not None else scratch
    root.mkdir(parents=True, exist_ok=True)
    run = _Run(data, recipe or Recipe(), max_drop, root, say, deadline)
    try:
        result = _compress(module, run, method, amount, importance, student, train)
        result.model, result.metric = type(module).__name__, metric
        _time_rows(result, run, rounds, runs)
        if output is not None:
            _write_output(result, Path(output), force)
        return result
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


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
    student: Any,
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
            small = _student(module, student)
            longer = run.recipe.scaled(DISTILL_EPOCHS)
            distill(module, small, data, longer, run.tick("distilling"), run.deadline)
            rows.append(_row(run, "distill", small, "fp32"))
        else:
            rows.append(_row(run, "combined", _combined(module, run, amount, importance), "int8"))
    return result


def _qat(module: nn.Module, run: _Run) -> nn.Module:
    return qat(module, run.data, run.recipe, run.tick("quantization-aware training"), run.deadline)


def _student(teacher: nn.Module, student: Any) -> nn.Module:
    if student is None:
        return smaller(teacher)
    return student() if not isinstance(student, nn.Module) else student


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


def _write_output(result: Result, output: Path, force: bool) -> None:
    """The fastest artifact within the budget (on test accuracy) copied to `output`."""
    base = result.row("fp32").accuracy
    within = [r for r in result.rows if base - r.accuracy <= result.max_drop]
    if result.rows[1:] and not any(r.method != "fp32" for r in within):
        worst = ", ".join(f"{r.method} {(base - r.accuracy) * 100:.1f} pt" for r in result.rows[1:])
        raise KilnError(
            f"no compressed model stays within --max-drop {result.max_drop:g} of the fp32 "
            f"test accuracy {base:.1%} (drops: {worst}). Nothing was written; allow a larger "
            "--max-drop or train longer."
        )
    best = min((r for r in within if r.method != "fp32"), key=lambda r: r.p50_ms or 0.0,
               default=result.row("fp32"))  # fmt: skip
    staging = output.absolute().parent / f".{output.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(best.artifact, staging)
    if output.exists():
        check_destination(output, force)
        shutil.rmtree(output)
    os.replace(staging, output)
    result.chosen, result.output = best.method, str(output)
