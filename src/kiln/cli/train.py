"""`kiln train`: a user's PyTorch model trained by Kiln's loop under a TrainConfig — mixed
precision, accumulation, checkpointing, DDP/FSDP2/pipeline ranks — with a progress bar, a
final table and a JSON training record."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from kiln.cli.console import JsonOpt, PlainProgress, at_least, console, emit_json, err
from kiln.cli.stopped import Stopped
from kiln.cli.tune import parse_duration
from kiln.errors import KilnError, counted


def train(
    model: Annotated[
        str,
        typer.Argument(
            help="module:factory returning a torch.nn.Module, e.g. "
            "kiln.train.examples:byte_lm_small."
        ),
    ],
    data: Annotated[
        str,
        typer.Option(
            "--data",
            help="module:function returning a map-style Dataset of (input, target) pairs, or "
            '{"train": ..., "val": ...}, e.g. kiln.train.examples:stdlib_text_small.',
        ),
    ],
    batch: Annotated[
        int,
        typer.Option(
            help="The global batch: samples per optimizer step over every rank (= micro_batch "
            "× accumulation × data-parallel ranks)."
        ),
    ],
    steps: Annotated[int | None, typer.Option(help="Optimizer steps to take.")] = None,
    epochs: Annotated[float | None, typer.Option(help="Passes over the training set.")] = None,
    time: Annotated[str | None, typer.Option("--time", help="Train this long, e.g. 10m.")] = None,
    loss: Annotated[
        str | None,
        typer.Option(
            help="module:fn(output, target) -> loss (default: cross-entropy over the "
            "last dim, so [B, T, V] token logits work)."
        ),  # fmt: skip
    ] = None,
    optimizer: Annotated[
        str | None,
        typer.Option(
            help="module:fn(params) -> torch.optim.Optimizer (default: AdamW, lr "
            "1e-3, weight decay 0.01)."
        ),  # fmt: skip
    ] = None,
    config: Annotated[
        Path | None,
        typer.Option(
            help="A TrainConfig JSON (a bare config, or a training record's "
            '"config"); the flags below override its fields.'
        ),  # fmt: skip
    ] = None,
    precision: Annotated[
        str | None, typer.Option(help="fp32, bf16 (autocast) or fp16 (autocast + loss scaling).")
    ] = None,
    accumulation: Annotated[
        int | None, typer.Option(help="Micro-batches per optimizer step.")
    ] = None,
    checkpointing: Annotated[
        str | None,
        typer.Option(help="Activation checkpointing: none, full or every (every 2nd block)."),
    ] = None,
    clip_grad_norm: Annotated[
        float | None,
        typer.Option(help="Clip the gradients' global norm to this (the record keeps the norm)."),
    ] = None,
    lr_schedule: Annotated[
        str | None,
        typer.Option(
            help="The learning rate over the run: constant, linear or cosine (decay to 0 "
            "over --steps/--epochs), or module:fn(optimizer) -> LRScheduler of your own."
        ),  # fmt: skip
    ] = None,
    warmup: Annotated[
        int | None,
        typer.Option(help="Optimizer steps over which the learning rate first rises to its own."),
    ] = None,
    strategy: Annotated[
        str | None,
        typer.Option(help="single, ddp, fsdp2 or pipeline (several ranks: give --nproc)."),
    ] = None,
    nproc: Annotated[
        int | None,
        typer.Option(
            help="Ranks on this machine, started by torchrun's launcher (gloo on "
            "CPUs, NCCL on GPUs); default the config's ranks."
        ),  # fmt: skip
    ] = None,
    nnodes: Annotated[
        str,
        typer.Option(
            help="Machines taking part, torchrun's N or MIN:MAX (each runs this same "
            "command; the world is --nproc × nodes)."
        ),  # fmt: skip
    ] = "1",
    rdzv_endpoint: Annotated[
        str | None,
        typer.Option(
            help="host:port where the machines meet (torchrun's c10d rendezvous); "
            "needed with --nnodes above 1."
        ),  # fmt: skip
    ] = None,
    checkpoint: Annotated[
        Path | None,
        typer.Option(
            help="Directory for torch.distributed.checkpoint checkpoints (every "
            "--checkpoint-every steps and at the end; written whole or not at all, so "
            "Ctrl-C or a killed job leaves the newest one loadable)."
        ),  # fmt: skip
    ] = None,
    checkpoint_every: Annotated[
        int, typer.Option(min=1, help="Optimizer steps between checkpoints.")
    ] = 50,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            help="Continue from the newest checkpoint in --checkpoint, under the config it "
            "was made with (its global batch, precision, loss scale, fp32 modules, gradient "
            "clipping, schedule, seed and shuffling). The strategy may change; another "
            "number of data-parallel ranks goes on from the same sample count, but shards "
            "and draws differently from the run it continues.",
        ),  # fmt: skip
    ] = False,
    allow_config_change: Annotated[
        bool,
        typer.Option(
            "--allow-config-change",
            help="With --resume: go on although the config changes the data order or the "
            "math, so the run no longer continues the one checkpointed.",
        ),  # fmt: skip
    ] = False,
    profile: Annotated[
        Path | None,
        typer.Option(
            help="After training, profile a few steps (data, forward, backward, "
            "optimizer, communication; FLOP/s and MFU; memory) into this HTML "
            "report."
        ),  # fmt: skip
    ] = None,
    tune: Annotated[
        bool,
        typer.Option(
            "--tune",
            help="Search the fastest TrainConfig at this --batch instead of "
            "training: each trial trains --steps steps (default 20) in a process of "
            "its own, must train as well as the config given and is confirmed against "
            "it; -o writes the tuned config, which --config reads.",
        ),  # fmt: skip
    ] = False,
    trials: Annotated[
        int | None, typer.Option(help="With --tune: configurations to measure (default 12).")
    ] = None,
    max_memory: Annotated[
        str | None,
        typer.Option(
            help="With --tune: the peak memory a trial's processes may reach, with its "
            "unit (kB, MB, GB decimal; KiB, MiB, GiB binary), e.g. 2GiB; a trial past it is "
            "stopped."
        ),  # fmt: skip
    ] = None,
    target_loss: Annotated[
        float | None,
        typer.Option(
            help="With --tune: minimise the time to reach this training loss instead "
            "of maximising samples/s."
        ),  # fmt: skip
    ] = None,
    storage: Annotated[
        str | None,
        typer.Option(
            help="With --tune: study and strategy-library database URL (default: "
            "sqlite under KILN_HOME), as kiln tune."
        ),  # fmt: skip
    ] = None,
    study: Annotated[
        str | None,
        typer.Option(
            help="With --tune: the study's name (default: from the model, data, "
            "batch, objective and limits); reuse it to resume."
        ),  # fmt: skip
    ] = None,
    record: Annotated[
        Path | None,
        typer.Option(
            "-o", "--output", help="Write the training record here (with --tune: the tuned config)."
        ),  # fmt: skip
    ] = None,
    save: Annotated[
        Path | None,
        typer.Option(
            help="Write the trained weights here as a plain state_dict (torch.save; "
            "model.load_state_dict of the user's own module takes it)."
        ),  # fmt: skip
    ] = None,
    export: Annotated[
        Path | None,
        typer.Option(
            help="Write the trained model here: model.onnx (for kiln optimize and "
            "kiln serve) or model.pt2 (torch.export), traced on a training batch "
            "with a dynamic batch dim."
        ),  # fmt: skip
    ] = None,
    val_every: Annotated[
        str | None,
        typer.Option(
            help="Validate on the data's validation set every N optimizer steps, or each "
            "epoch (epoch); with --checkpoint the lowest validation loss's step is kept in "
            "DIR/best."
        ),  # fmt: skip
    ] = None,
    early_stop: Annotated[
        int | None,
        typer.Option(
            help="Stop after this many validations in a row without a lower loss "
            "(needs --val-every)."
        ),  # fmt: skip
    ] = None,
    metrics: Annotated[
        Path | None,
        typer.Option(
            help="Write metrics into this directory as they happen: metrics.jsonl (a line "
            "per step: loss, lr, grad_norm, samples/s; one per validation) and TensorBoard "
            "event files where tensorboard is installed."
        ),  # fmt: skip
    ] = None,
    progress_every: Annotated[
        float,
        typer.Option(
            min=0,
            help="Where stderr is not a terminal (a batch job, | tee, nohup): a plain "
            "progress line every this many seconds.",
        ),  # fmt: skip
    ] = 30.0,
    as_json: JsonOpt = False,
) -> None:
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
    if steps is not None:
        at_least(steps=(steps, 1))
    from kiln.compress.loading import load_callable
    from kiln.train.config import TrainConfig, read_config, recorded_functions

    tuning = {"--trials": trials, "--max-memory": max_memory, "--target-loss": target_loss,
              "--storage": storage, "--study": study}  # fmt: skip
    _check_tuning(tune, tuning, {"--epochs": epochs, "--checkpoint": checkpoint,
                                 "--resume": resume or None, "--profile": profile,
                                 "--save": save, "--export": export,
                                 "--val-every": val_every, "--early-stop": early_stop,
                                 "--metrics": metrics})  # fmt: skip
    base = read_config(config) if config else TrainConfig()
    recorded = recorded_functions(config) if config else {}  # a record's --loss, --optimizer
    loss, optimizer = loss or recorded.get("loss"), optimizer or recorded.get("optimizer")
    nodes = nnodes.split(":")[-1]
    if not nodes.isdigit() or int(nodes) < 1:
        raise KilnError(f"--nnodes {nnodes}: give N or MIN:MAX, e.g. 2 or 1:4.")
    world = nproc * int(nodes) if nproc is not None else None
    chosen = _config(base, batch, precision, accumulation, checkpointing, strategy, world)
    math = {"clip_grad_norm": clip_grad_norm, "lr_schedule": lr_schedule, "warmup": warmup}
    chosen = chosen.replace(**{k: v for k, v in math.items() if v is not None})
    seconds = parse_duration(time) if time else None
    if tune:
        specs = {"model": model, "data": data, "loss": loss, "optimizer": optimizer}
        _tune(specs, chosen, batch, steps, seconds, tuning, record, as_json)
        return
    functions = {
        "model": load_callable(model, "model"),
        "data": load_callable(data, "--data"),
        "loss": load_callable(loss, "--loss") if loss else None,
        "optimizer": load_callable(optimizer, "--optimizer") if optimizer else None,
    }
    _oversubscribed(nproc)
    if record is not None and record.is_dir():
        raise KilnError(f"-o {record} is a directory; give a file name for the record.")
    options = {"nnodes": nnodes, "rdzv_endpoint": rdzv_endpoint,
               "checkpoint_every": checkpoint_every, "save": save, "export": export}  # fmt: skip
    options["allow_config_change"] = allow_config_change
    options["progress_every"] = progress_every
    options["val_every"] = int(val_every) if val_every and val_every.isdigit() else val_every
    options["early_stop"], options["metrics"] = early_stop, metrics
    try:
        result = _run(functions, chosen, steps, epochs, seconds, checkpoint, resume, profile,
                      options)  # fmt: skip
    except (Stopped, KeyboardInterrupt) as exc:
        raise _stopped(exc, checkpoint) from None
    result = {"model": model, "data": data, "loss_function": loss, "optimizer": optimizer,
              **result}  # fmt: skip
    if record is not None:
        from kiln.home import atomic_write_json

        atomic_write_json(record, result)
    if as_json:
        emit_json(result)
    else:
        _table(result, record)


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


def _check_tuning(tune: bool, tuning: dict[str, Any], training: dict[str, Any]) -> None:
    """Tuning flags only with --tune; flags of a training run not with it."""
    given = [flag for flag, value in tuning.items() if value is not None]
    if given and not tune:
        raise KilnError(f"{given[0]} is a flag of kiln train --tune: add --tune, or drop it.")
    given = [flag for flag, value in training.items() if value is not None]
    if given and tune:
        raise KilnError(f"{given[0]} is for training runs, not --tune: tune first (-o FILE), then "
                        "train with --config FILE.")  # fmt: skip


def _tune(specs: dict[str, str | None], base: Any, batch: int, steps: int | None,
          seconds: float | None, tuning: dict[str, Any], output: Path | None,
          as_json: bool) -> None:  # fmt: skip
    """--tune: search, write the tuned config (-o), show the trials and the pick."""
    from kiln.cli.console import progress
    from kiln.train.tune import PROBE_STEPS, TRIALS, tune
    from kiln.tune.objectives import parse_constraint

    limit = tuning["--max-memory"]
    cap = parse_constraint("max_memory", limit).bound if limit is not None else None
    with _tuning_stopped(), progress() as bar:
        task = bar.add_task(f"tuning {specs['model']}")
        result = tune(specs["model"], specs["data"], loss=specs["loss"],
                      optimizer=specs["optimizer"], base=base, global_batch=batch,
                      seconds=seconds, trials=tuning["--trials"] or TRIALS,
                      max_memory_mib=cap, target_loss=tuning["--target-loss"],
                      storage=tuning["--storage"], study=tuning["--study"],
                      probe_steps=steps or PROBE_STEPS, output=output,
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
    from kiln.train.tune import describe

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


def _config(base: Any, batch: int, precision: str | None, accumulation: int | None,
            checkpointing: str | None, strategy: str | None, nproc: int | None) -> Any:  # fmt: skip
    """The config with the flags applied; micro_batch follows from --batch."""
    changes: dict[str, Any] = {}
    if precision is not None:
        changes["precision"] = precision
    if accumulation is not None:
        changes["accumulation"] = accumulation
    if checkpointing is not None:
        changes["checkpointing"] = {"policy": checkpointing}
    parallel: dict[str, Any] = {}
    if strategy is not None:
        parallel["strategy"] = strategy
    if nproc is not None:
        parallel["ranks"] = nproc
        if nproc > 1 and strategy is None and base.parallel.strategy == "single":
            parallel["strategy"] = "ddp"  # several ranks and no strategy: data parallel
    if parallel:
        changes["parallel"] = parallel
    config = base.replace(**changes) if changes else base
    replicas = 1 if config.parallel.strategy == "pipeline" else config.parallel.ranks
    per_step = config.accumulation * replicas
    if batch < 1 or batch % per_step:
        raise KilnError(
            f"--batch {batch} does not split into accumulation {config.accumulation} × "
            f"{replicas} data-parallel rank(s): give a multiple of {per_step}."
        )
    return config.replace(micro_batch=batch // per_step)


def _run(functions: dict[str, Any], config: Any, steps: int | None, epochs: float | None,
         seconds: float | None, checkpoint: Path | None, resume: bool,
         profile: Path | None, options: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    from kiln.train import fit

    columns = [
        TextColumn("{task.description}", markup=False),
        BarColumn(),
        TextColumn("{task.fields[status]}", markup=False),
        TimeRemainingColumn(),
    ]
    with Progress(*columns, console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task(f"training ({config.parallel.ranks} rank(s))", total=steps,
                            status="starting")  # fmt: skip

        def tick(state: dict[str, Any]) -> None:
            bar.update(task, completed=state["step"], total=state["steps"],
                       status=_status(state))  # fmt: skip

        # Off a terminal the bar is disabled: a log gets a plain line now and then instead.
        every = options.pop("progress_every")
        progress = tick if err.is_terminal else PlainProgress(_log_line, every)
        return fit(functions["model"], functions["data"], loss=functions["loss"],
                   optimizer=functions["optimizer"], config=config, steps=steps, epochs=epochs,
                   seconds=seconds, checkpoint=checkpoint, resume=resume, profile=profile,
                   **options,
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
