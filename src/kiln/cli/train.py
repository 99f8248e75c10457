"""`kiln train`: a user's PyTorch model trained by Kiln's loop under a TrainConfig — mixed
precision, accumulation, checkpointing, DDP/FSDP2/pipeline ranks — with a progress bar, a
final table and a JSON training record."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from kiln.cli.console import JsonOpt, PlainProgress, at_least, console, duration, emit_json, err
from kiln.cli.flags import Flag, command, options
from kiln.cli.stopped import Stopped
from kiln.errors import KilnError, counted
from kiln.train.config import CHECKPOINTING, PRECISIONS, STRATEGIES, TrainConfig


@dataclass(frozen=True)
class Run:
    """How long a training run goes, what it keeps and where its ranks run (`kiln.train.fit`'s
    settings; none of them changes what a step computes)."""

    steps: int | None = None
    """Optimizer steps to take."""
    epochs: float | None = None
    """Passes over the training set."""
    seconds: float | None = None
    """Train this long, e.g. 10m."""
    nproc: int | None = None
    """Ranks on this machine, started by torchrun's launcher (gloo on CPUs, NCCL on GPUs);
    default the config's ranks."""
    nnodes: str = "1"
    """Machines taking part, torchrun's N or MIN:MAX (each runs this same command; the world
    is --nproc × nodes)."""
    rdzv_endpoint: str | None = None
    """host:port where the machines meet (torchrun's c10d rendezvous); needed with --nnodes
    above 1."""
    checkpoint: Path | None = None
    """Directory for torch.distributed.checkpoint checkpoints (every --checkpoint-every steps
    and at the end; written whole or not at all, so Ctrl-C or a killed job leaves the newest
    one loadable)."""
    checkpoint_every: int = 50
    """Optimizer steps between checkpoints."""
    resume: bool = False
    """Continue from the newest checkpoint in --checkpoint, under the config it was made with
    (its global batch, precision, loss scale, fp32 modules, gradient clipping, schedule, seed
    and shuffling). The strategy may change; another number of data-parallel ranks goes on
    from the same sample count, but shards and draws differently from the run it continues."""
    allow_config_change: bool = False
    """With --resume: go on although the config changes the data order or the math, so the
    run no longer continues the one checkpointed."""
    profile: Path | None = None
    """After training, profile a few steps (data, forward, backward, optimizer,
    communication; FLOP/s and MFU; memory) into this HTML report."""
    save: Path | None = None
    """Write the trained weights here as a plain state_dict (torch.save; model.load_state_dict
    of the user's own module takes it)."""
    export: Path | None = None
    """Write the trained model here: model.onnx (for kiln optimize and kiln serve) or
    model.pt2 (torch.export), traced on a training batch with a dynamic batch dim."""
    val_every: str | None = None
    """Validate on the data's validation set every N optimizer steps, or each epoch (epoch);
    with --checkpoint the lowest validation loss's step is kept in DIR/best."""
    early_stop: int | None = None
    """Stop after this many validations in a row without a lower loss (needs --val-every)."""
    metrics: Path | None = None
    """Write metrics into this directory as they happen: metrics.jsonl (a line per step:
    loss, lr, grad_norm, samples/s; one per validation) and TensorBoard event files where
    tensorboard is installed."""
    progress_every: float = 30.0
    """Where stderr is not a terminal (a batch job, | tee, nohup): a plain progress line
    every this many seconds."""


# The flags of a training run that --tune refuses (a tuning run trains only its trials).
TRAINING_ONLY = ("epochs", "checkpoint", "resume", "profile", "save", "export", "val_every",
                 "early_stop", "metrics")  # fmt: skip


@dataclass(frozen=True)
class Tuning:
    """`kiln train --tune`: the search for the fastest TrainConfig at the given batch."""

    tune: bool = False
    """Search the fastest TrainConfig at this --batch instead of training: each trial trains
    --steps steps (default 20) in a process of its own, must train as well as the config
    given and is confirmed against it; -o writes the tuned config, which --config reads."""
    trials: int | None = None
    """With --tune: configurations to measure (default 12)."""
    max_memory: str | None = None
    """With --tune: the peak memory a trial's processes may reach, with its unit (kB, MB, GB
    decimal; KiB, MiB, GiB binary), e.g. 2GiB; a trial past it is stopped."""
    target_loss: float | None = None
    """With --tune: minimise the time to reach this training loss instead of maximising
    samples/s."""
    storage: str | None = None
    """With --tune: study and strategy-library database URL (default: sqlite under
    KILN_HOME), as kiln tune."""
    study: str | None = None
    """With --tune: the study's name (default: from the model, data, batch, objective and
    limits); reuse it to resume."""


ModelArg = Annotated[
    str,
    typer.Argument(
        help="module:factory returning a torch.nn.Module, e.g. kiln.train.examples:byte_lm_small."
    ),
]
DataOpt = Annotated[
    str,
    typer.Option(
        "--data",
        help="module:function returning a map-style Dataset of (input, target) pairs, or "
        '{"train": ..., "val": ...}, e.g. kiln.train.examples:stdlib_text_small.',
    ),
]
BatchOpt = Annotated[
    int,
    typer.Option(
        help="The global batch: samples per optimizer step over every rank (= micro_batch × "
        "accumulation × data-parallel ranks)."
    ),
]
LossOpt = Annotated[
    str | None,
    typer.Option(
        help="module:fn(output, target) -> loss (default: cross-entropy over the last dim, so "
        "[B, T, V] token logits work)."
    ),
]
OptimizerOpt = Annotated[
    str | None,
    typer.Option(
        help="module:fn(params) -> torch.optim.Optimizer (default: AdamW, lr 1e-3, weight "
        "decay 0.01)."
    ),
]
ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        help='A TrainConfig JSON (a bare config, or a training record\'s "config"); the flags '
        "below override its fields."
    ),
]
RecordOpt = Annotated[
    Path | None,
    typer.Option(
        "-o", "--output", help="Write the training record here (with --tune: the tuned config)."
    ),
]
CONFIG_FLAGS = options(
    TrainConfig, "precision", "accumulation", "checkpointing.policy", "clip_grad_norm",
    "lr_schedule", "warmup", "parallel.strategy", override=True, panel="TrainConfig",
    flags={"precision": Flag(choices=PRECISIONS),
           "checkpointing.policy": Flag(names=("--checkpointing",), choices=CHECKPOINTING),
           "parallel.strategy": Flag(names=("--strategy",), choices=STRATEGIES)},
)  # fmt: skip
RUN_FLAGS = options(Run, panel="The run", flags={
    "seconds": Flag(names=("--time",), type=str | None, parse=duration),
    "resume": Flag(names=("--resume",)),
    "allow_config_change": Flag(names=("--allow-config-change",)),
})  # fmt: skip
TUNING_FLAGS = options(Tuning, panel="Tuning (--tune)", flags={"tune": Flag(names=("--tune",))})


@command
def train(
    model: ModelArg, data: DataOpt, batch: BatchOpt, loss: LossOpt = None,
    optimizer: OptimizerOpt = None, config: ConfigOpt = None, changes: Any = CONFIG_FLAGS,
    run: Any = RUN_FLAGS, tuning: Any = TUNING_FLAGS, record: RecordOpt = None,
    as_json: JsonOpt = False,
) -> None:  # fmt: skip
    """Train MODEL on --data with Kiln's loop and a TrainConfig.

      kiln train kiln.train.examples:byte_lm_small --data kiln.train.examples:stdlib_text_small \\
          --batch 8 --steps 200 --precision bf16

    Several ranks: --nproc 2 --strategy ddp (or fsdp2, pipeline). The record (-o, --json)
    holds the config, per-step loss, samples/s, loss-scale events and peak memory per rank.
    With --tune (--time, --trials, --max-memory, --target-loss) the flags give the config to
    beat, and -o writes the one that beat it.
    """
    from kiln.train import require_torch

    require_torch("kiln train")
    _check(run, tuning)
    from kiln.compress.loading import load_callable
    from kiln.train.config import read_config, recorded_functions

    base = read_config(config) if config else TrainConfig()
    recorded = recorded_functions(config) if config else {}  # a record's --loss, --optimizer
    loss, optimizer = loss or recorded.get("loss"), optimizer or recorded.get("optimizer")
    chosen = _config(base, batch, changes, _world(run))
    specs = {"model": model, "data": data, "loss": loss, "optimizer": optimizer}
    if tuning.tune:
        return _tune(specs, chosen, batch, run, tuning, record, as_json)
    functions = {name: load_callable(spec, "model" if name == "model" else f"--{name}")
                 if spec else None for name, spec in specs.items()}  # fmt: skip
    _oversubscribed(run.nproc)
    if record is not None and record.is_dir():
        raise KilnError(f"-o {record} is a directory; give a file name for the record.")
    try:
        result = _run(functions, chosen, run)
    except (Stopped, KeyboardInterrupt) as exc:
        raise _stopped(exc, run.checkpoint) from None
    result = {"model": model, "data": data, "loss_function": loss, "optimizer": optimizer,
              **result}  # fmt: skip
    if record is not None:
        from kiln.home import atomic_write_json

        atomic_write_json(record, result)
    if as_json:
        return emit_json(result)
    _table(result, record)


def _check(run: Run, tuning: Tuning) -> None:
    """Counts at their minimum; tuning flags only with --tune, flags of a training run not
    with it."""
    if run.steps is not None:
        at_least(steps=(run.steps, 1))
    at_least(checkpoint_every=(run.checkpoint_every, 1))
    if run.progress_every < 0:
        raise KilnError(f"--progress-every {run.progress_every:g}: give 0 or more seconds.")
    flag = lambda name: "--" + name.replace("_", "-")  # noqa: E731
    given = [flag(k) for k, v in asdict(tuning).items() if k != "tune" and v is not None]
    if given and not tuning.tune:
        raise KilnError(f"{given[0]} is a flag of kiln train --tune: add --tune, or drop it.")
    default = Run()
    given = [flag(k) for k in TRAINING_ONLY if getattr(run, k) != getattr(default, k)]
    if given and tuning.tune:
        raise KilnError(f"{given[0]} is for training runs, not --tune: tune first (-o FILE), then "
                        "train with --config FILE.")  # fmt: skip


def _world(run: Run) -> int | None:
    """Ranks over every node: --nproc × the nodes (the most, for MIN:MAX)."""
    nodes = run.nnodes.split(":")[-1]
    if not nodes.isdigit() or int(nodes) < 1:
        raise KilnError(f"--nnodes {run.nnodes}: give N or MIN:MAX, e.g. 2 or 1:4.")
    return run.nproc * int(nodes) if run.nproc is not None else None


def _oversubscribed(nproc: int | None) -> None:
    """A note where the ranks outnumber the cores: they take turns on them, and every
    collective waits for a rank that is not running."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if nproc and cores and nproc > cores:
        err.print(f"note: --nproc {nproc} on {cores} cores: the ranks take turns on the cores "
                  "and each collective waits for one that is not running; steps will be "
                  f"slower than with --nproc {cores}.", highlight=False, markup=False)  # fmt: skip


def _stopped(exc: Stopped | KeyboardInterrupt, checkpoint: Path | None) -> Stopped:
    """The stop, saying which checkpoint survived it: a checkpoint is renamed into place
    only when whole, so the newest one is loadable whatever the moment of the signal."""
    signum = exc.signum if isinstance(exc, Stopped) else signal.SIGINT
    from kiln.train.checkpoint import latest

    found = latest(checkpoint) if checkpoint is not None and checkpoint.is_dir() else None
    if found is None:
        return Stopped(signum, "no checkpoint was written.")
    return Stopped(signum, f"the newest checkpoint, {found}, is whole: run the same command "
                           "with --resume to continue from it.")  # fmt: skip


def _tune(specs: dict[str, str | None], base: TrainConfig, batch: int, run: Run,
          tuning: Tuning, output: Path | None, as_json: bool) -> None:  # fmt: skip
    """--tune: search, write the tuned config (-o), show the trials and the pick."""
    from kiln.cli.console import progress
    from kiln.train.tuning import PROBE_STEPS, TRIALS, tune
    from kiln.units import parse_size

    cap = None
    if tuning.max_memory is not None:
        try:
            cap = parse_size(tuning.max_memory, bare_unit=None) / 2**20
        except ValueError as exc:
            raise KilnError(f"--max-memory {exc}.") from None
    with _tuning_stopped(), progress() as bar:
        task = bar.add_task(f"tuning {specs['model']}")
        result = tune(specs["model"], specs["data"], loss=specs["loss"],
                      optimizer=specs["optimizer"], base=base, global_batch=batch,
                      seconds=run.seconds, trials=tuning.trials or TRIALS,
                      max_memory_mib=cap, target_loss=tuning.target_loss,
                      storage=tuning.storage, study=tuning.study,
                      probe_steps=run.steps or PROBE_STEPS, output=output,
                      progress=lambda msg: bar.update(task, description=msg))  # fmt: skip
    if as_json:
        emit_json(result)
    else:
        _tune_table(result, output)


@contextlib.contextmanager
def _tuning_stopped() -> Iterator[None]:
    """A stop while tuning names what it kept: the trial running is ended with Kiln, the
    finished ones stay in the study, which the same command resumes."""
    try:
        yield
    except (Stopped, KeyboardInterrupt) as exc:
        signum = exc.signum if isinstance(exc, Stopped) else signal.SIGINT
        raise Stopped(signum, "the trial running was ended; the finished trials are kept in "
                      "the study, which the same command resumes; no tuned config was "
                      "written.") from None  # fmt: skip


def _tune_table(result: dict[str, Any], output: Path | None) -> None:
    from rich.table import Table

    from kiln.train.config import TrainConfig
    from kiln.train.tuning import describe

    table = Table(title=f"{result['model']} on {result['data']}, global batch "
                  f"{result['global_batch']}: study {result['study']}")  # fmt: skip
    for column in ("trial", "config", "samples/s", "peak MiB", "loss", "state"):
        table.add_column(column, justify="right" if column != "config" else "left")
    for row in result["trials"]:
        if row["duplicate_of"] is not None:
            continue
        config = describe(TrainConfig.from_json(row["config"])) if row["config"] else ""
        figures = [f"{row[k]:{f}}" if row[k] is not None else "" for k, f in
                   (("samples_per_s", ".1f"), ("peak_mib", ".0f"), ("loss", ".4f"))]  # fmt: skip
        state = "measured" if row["state"] == "COMPLETE" else row["reason"] or row["state"]
        table.add_row(str(row["trial"]), config, *figures, state)
    console.print(table)
    speed = result["speedup"]
    gain = f" ({speed['value']:.2f}×, {speed['low']:.2f}–{speed['high']:.2f})" if speed else ""
    kept = "adopted" if result["adopted"] else "the base is kept"
    pick = describe(TrainConfig.from_json(result["config"]))
    console.print(f"pick: {pick} — {result['verdict']}{gain}; {kept}", highlight=False)
    if output is not None:
        console.print(f"tuned config: {output} (kiln train --config {output})", highlight=False)


def _config(base: TrainConfig, batch: int, changes: dict[str, Any],
            nproc: int | None) -> TrainConfig:  # fmt: skip
    """The config with the flags applied; micro_batch follows from --batch."""
    nested: dict[str, Any] = {}
    for path, value in changes.items():
        section, _, name = path.rpartition(".")
        (nested.setdefault(section, {}) if section else nested)[name] = value
    if nproc is not None:
        parallel = nested.setdefault("parallel", {})
        parallel["ranks"] = nproc
        if nproc > 1 and "strategy" not in parallel and base.parallel.strategy == "single":
            parallel["strategy"] = "ddp"  # several ranks and no strategy: data parallel
    config = base.replace(**nested) if nested else base
    replicas = 1 if config.parallel.strategy == "pipeline" else config.parallel.ranks
    per_step = config.accumulation * replicas
    if batch < 1 or batch % per_step:
        raise KilnError(
            f"--batch {batch} does not split into accumulation {config.accumulation} × "
            f"{replicas} data-parallel rank(s): give a multiple of {per_step}."
        )
    return config.replace(micro_batch=batch // per_step)


def _run(functions: dict[str, Any], config: TrainConfig, run: Run) -> dict[str, Any]:
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from kiln.train import fit

    columns = [
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        TextColumn("{task.fields[status]}", markup=False),
        TimeRemainingColumn(),
    ]
    with Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task(f"training ({config.parallel.ranks} rank(s))", total=run.steps,
                            status="starting")  # fmt: skip

        def tick(state: dict[str, Any]) -> None:
            bar.update(task, completed=state["step"], total=state["steps"],
                       status=_status(state))  # fmt: skip

        # Off a terminal the bar is disabled: a log gets a plain line now and then instead.
        progress = tick if err.is_terminal else PlainProgress(_log_line, run.progress_every)
        every = run.val_every
        return fit(functions["model"], functions["data"], loss=functions["loss"],
                   optimizer=functions["optimizer"], config=config, steps=run.steps,
                   epochs=run.epochs, seconds=run.seconds, checkpoint=run.checkpoint,
                   resume=run.resume, profile=run.profile, nnodes=run.nnodes,
                   rdzv_endpoint=run.rdzv_endpoint, checkpoint_every=run.checkpoint_every,
                   save=run.save, export=run.export,
                   allow_config_change=run.allow_config_change,
                   val_every=int(every) if every and every.isdigit() else every,
                   early_stop=run.early_stop, metrics=run.metrics,
                   progress=progress)  # fmt: skip


def _status(state: dict[str, Any], of: str = "") -> str:
    """Training's progress as the bar shows it (`of`: the steps in all, for a log)."""
    scale = f", scale {state['loss_scale']:g}" if state.get("loss_scale") else ""
    return (f"step {state['step']}{of}, loss {state['loss']:.4f}, "
            f"{state['samples_per_s']:.1f} samples/s{scale}")  # fmt: skip


def _log_line(state: dict[str, Any]) -> str:
    """Training's progress as a line of a log."""
    of = f" of {state['steps']}" if state.get("steps") else ""
    return f"training: {_status(state, of)}, {state['seconds']:.0f} s in"


def _table(result: dict[str, Any], record: Path | None) -> None:
    from rich.table import Table

    config = result["config"]
    parallel = config["parallel"]
    table = Table(title=f"{result['model']} on {result['data']}: {config['precision']}, "
                  f"{parallel['strategy']} × {parallel['ranks']}, global batch "
                  f"{result['global_batch']}")  # fmt: skip
    table.add_column("measure")
    table.add_column("value", justify="right")
    rows = [("steps", f"{result['steps']} ({result['steps_this_run']} this run)"),
            ("samples/s", f"{result['samples_per_s']:.1f}")]  # fmt: skip
    if result.get("tokens_per_s"):
        rows.append(("tokens/s", f"{result['tokens_per_s']:.0f}"))
    if result.get("final_loss") is not None:
        rows.append(("training loss, last 10 % of this run", f"{result['final_loss']:.4f}"))
    val = result.get("val") or {}
    if "loss" in val:
        rows.append(("validation loss", f"{val['loss']:.4f}"))
    if "accuracy" in val:
        rows.append(("validation accuracy", f"{val['accuracy']:.1%}"))
    best = result.get("best")
    if best:
        kept = f", {best['checkpoint']}" if best["checkpoint"] else ""
        stop = ", stopped early" if result.get("stopped_early") else ""
        note = f"step {best['step']}{kept}{stop}"
        rows.append(("best validation loss", f"{best['loss']:.4f} ({note})"))
    for rank, mib in sorted(result["peak_mib"].items()):
        rows.append((f"peak RSS (process), rank {rank}", f"{mib:.0f} MiB"))
    scale = result["scale"]
    if scale["final"] is not None:
        skipped = counted(scale["skipped"], "step")
        rows.append(("loss scale", f"{scale['final']:g} ({skipped} skipped)"))
    if result.get("checkpoint"):
        rows.append(("checkpoint", result["checkpoint"]))
    written = result.get("written") or {}
    rows += [(label, written[key]) for key, label in (("save", "trained weights"),
             ("export", "trained model")) if key in written]  # fmt: skip
    if result.get("profile"):
        profile = result["profile"]
        rows.append(("profile", profile["report"] or f"failed ({profile['error']})"))
    if record is not None:
        rows.append(("record", str(record)))
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
