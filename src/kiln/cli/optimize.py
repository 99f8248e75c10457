"""`kiln optimize`: compile a model into a verified artifact, timed against ONNX Runtime."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from kiln.cli.console import JsonOpt, at_least, console, emit_json, progress, speed_advice
from kiln.cli.flags import Flag, command, options
from kiln.cli.pipeline import DataOpt, ModelsOpt, StreamsOpt, is_pipeline_call, optimize_pipeline
from kiln.config import ENGINES, CompileConfig, TimingConfig
from kiln.errors import KilnError, counted

ModelArg = Annotated[
    str | None,
    typer.Argument(
        help="An .onnx file, a .pt2 saved by torch.export.save (needs PyTorch; verified against "
        "the program's own outputs on its saved example inputs), or zoo:NAME (see `kiln zoo "
        "list`)."
    ),
]
OutputOpt = Annotated[
    Path | None, typer.Option("-o", "--output", help="Artifact directory (NAME.kiln).")
]
SkipOpt = Annotated[
    list[str], typer.Option("--skip-pass", help="Leave this pass out (repeatable).")
]
ShowOpt = Annotated[bool, typer.Option("--show-pipeline", help="Print the pass pipeline and exit.")]
ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config",
        help="Rebuild from a recorded CompileConfig: an artifact's manifest.json (or the "
        "artifact directory, or a bare config JSON). MODEL defaults to the artifact's source "
        "model; the config fixes every compile decision, so other compile flags are refused.",
    ),
]
ForceOpt = Annotated[
    bool,
    typer.Option(
        "--force",
        help="Replace whatever is at -o. Without it only a Kiln artifact holding nothing but "
        "its own files is replaced.",
    ),
]
MaxMemoryOpt = Annotated[
    str | None,
    typer.Option(
        "--max-memory",
        help="The artifact's peak resident memory must fit, e.g. 1.5GB or 800MiB: measured as "
        "a kiln.Session of it opened and run in a process of its own. Over it, the engine's "
        "memory-saving options are tried, cheapest in time first (ONNX Runtime: arena grown as "
        "requested, no memory pattern, no weight prepacking); the manifest records each one's "
        "peak and latency. Nothing fits: an error, nothing written.",
    ),
]
MemoryOpt = Annotated[
    bool | None,
    typer.Option(
        "--memory/--no-memory",
        help="Measure the artifact's peak resident memory (opened and run 10 times in a "
        "process of its own, seconds) into the JSON and the manifest's benchmark, beside this "
        "compile's own peak. Default: on for models with 64 MiB of weights or more.",
    ),
]


def _shapes(given: list[str]) -> dict[str, tuple[int, ...]]:
    from kiln.ir.inputs import parse_shapes

    return parse_shapes(given)


# The compile decisions a flag sets; the others (engine_options, pipeline, recipe) come from
# --config or the Python API.
COMPILE_FLAGS = options(
    CompileConfig, "engine", "precision", "metric", "max_drop", "calib", "calib_method",
    "block_size", "inputs", "shapes", "verify", "partition", "static",
    flags={"engine": Flag(names=("--backend",), choices=(*ENGINES, "auto")),
           "shapes": Flag(names=("--shape",), type=list[str], default=[], parse=_shapes),
           "verify": Flag(names=("--verify/--no-verify",)), "static": Flag(names=("--static",))},
    panel="Compile decisions (CompileConfig)",
)  # fmt: skip
# Timing, the same default as kiln.compile's.
TIMING_FLAGS = options(TimingConfig)


@command
def optimize(
    model: ModelArg = None, output: OutputOpt = None, config: Any = COMPILE_FLAGS,
    skip: SkipOpt = [], show_pipeline: ShowOpt = False,  # noqa: B006
    config_file: ConfigOpt = None, force: ForceOpt = False, timing: Any = TIMING_FLAGS,
    max_memory: MaxMemoryOpt = None, memory: MemoryOpt = None,
    as_json: JsonOpt = False, models: ModelsOpt = [], data: DataOpt = None,  # noqa: B006
    streams: StreamsOpt = 1,
) -> None:  # fmt: skip
    """Compile MODEL into a verified artifact and time it against ONNX Runtime as-is.

    Lossless by default: outputs match the original within fp32 tolerance, checked on
    reference inputs. A pass that breaks the outputs is found by bisection and dropped. The
    speedup comes with its spread over rounds and a verdict (faster, no different within
    noise, slower); --backend auto --precision auto tries every engine and precision.
    With --model and --data, MODEL is a pipeline function (MODULE:FUNCTION) over its models.
    """
    if is_pipeline_call(model, models, data):
        return optimize_pipeline(model, models, data, streams, config, output, force, as_json)
    from kiln.passes import default_pipeline

    rounds, runs = timing.rounds, timing.runs
    at_least(rounds=(rounds, 0), runs=(runs, 1))
    pipeline = [s for s in default_pipeline() if s.name not in _check_skip(skip)]
    if show_pipeline:
        return _show_pipeline(pipeline, as_json)
    from kiln.artifact.store import check_destination, existing
    from kiln.compiler import candidates
    from kiln.compiler.api import compile_loaded, load_source, memory_budget
    from kiln.partition import compile_partitioned

    if config_file is not None:
        config, model = _recorded(config, config_file, skip, max_memory, model)
    elif skip:  # the engines' own pipelines unless a pass is skipped
        config = config.replace(pipeline=tuple(s.name for s in pipeline))
    if model is None:
        raise KilnError("kiln optimize needs a MODEL: an .onnx file or zoo:NAME.")
    if config.is_auto and rounds <= 0:
        raise KilnError("auto picks the fastest candidate by timing; use --rounds > 0.")
    budget = memory_budget(max_memory) if max_memory is not None else None
    candidates(config)  # a missing engine or an unsupported precision fails before loading
    if output is not None:
        check_destination(output, force, source=model)  # before loading: a bad -o costs nothing
    with progress() as bar:
        task = bar.add_task(f"loading {model}")
        say = lambda msg: bar.update(task, description=msg)  # noqa: E731
        loaded = load_source(model)
        destination = output or Path(f"{loaded.name}.kiln")
        check_destination(destination, force, source=model)
        replaced = existing(destination)
        artifact = compile_loaded(loaded, config, destination, rounds=rounds, runs=runs,
                                  progress=say, force=force, max_memory_mib=budget,
                                  measure=_measure_memory, memory=memory,
                                  partitioned=compile_partitioned)  # fmt: skip
    _report(artifact, replaced, config, model, as_json)


def _report(artifact: Any, replaced: str, config: CompileConfig, model: str,
            as_json: bool) -> None:  # fmt: skip
    """The artifact's summary with the advice its verdict calls for: JSON, or the table."""
    summary = _optimize_summary(artifact, artifact.manifest.benchmark, replaced)
    verdict = (summary["benchmark"] or {}).get("verdict")
    summary["advice"] = speed_advice(
        verdict, "the artifact", "ONNX Runtime as-is", model, auto=_tried_everything(config)
    )
    if as_json:
        return emit_json(summary)
    from kiln.report.terminal import print_optimize

    print_optimize(summary, console)
    _print_partition(summary, console)


def _check_skip(skip: list[str]) -> list[str]:
    from kiln.passes import default_pipeline

    known = {s.name for s in default_pipeline()}
    for name in skip:
        if name not in known:
            raise KilnError(f"unknown pass '{name}' in --skip-pass; see --show-pipeline.")
    return skip


def _show_pipeline(pipeline: list, as_json: bool) -> None:
    from kiln.passes import format_pipeline

    if as_json:
        emit_json([_pass_json(i, spec) for i, spec in enumerate(pipeline, 1)])
    else:
        console.print(format_pipeline(pipeline), highlight=False, markup=False)


def _recorded(
    flags: CompileConfig, path: Path, skip: list[str], max_memory: str | None, model: str | None
) -> tuple[CompileConfig, str | None]:
    """--config: the recorded config and the model it was built from; refused beside a flag
    that sets a compile decision (one whose value differs from CompileConfig's default)."""
    from kiln.config import read_config

    default = CompileConfig()
    given = [_flag_of(name) for name in COMPILE_FLAGS.flags
             if getattr(flags, name) != getattr(default, name)]  # fmt: skip
    given += ["--skip-pass"] * bool(skip) + ["--max-memory"] * (max_memory is not None)
    if given:
        raise KilnError(
            f"--config fixes every compile decision; drop {', '.join(given)} or edit the "
            "config's JSON."
        )
    config, source = read_config(path)
    return config, model or source


def _flag_of(name: str) -> str:
    """The flag a user gives for a field: --backend for engine, --no-verify for verify."""
    names = COMPILE_FLAGS.flags[name].names
    return names[0].split("/")[-1] if names else "--" + name.replace("_", "-")


def _measure_memory(result: Any) -> dict[str, float]:
    """A candidate's memory: saved, then opened as a kiln.Session and run in a process of its
    own on its reference inputs (`kiln.runtime.footprint.peak_memory`), in MiB; and this
    process's own high-water mark."""
    import tempfile

    from kiln.compiler import save_result
    from kiln.runtime.footprint import peak_memory, peak_rss_mib

    with tempfile.TemporaryDirectory(prefix="kiln-optimize-memory-") as where:
        path = save_result(result, Path(where) / "candidate.kiln").path
        feeds = result.feeds[0] if result.feeds else None
        measured = peak_memory(path, feeds, runs=10)
    keys = ("peak_mib", "load_mib", "steady_mib")
    return {**{k: measured[k] for k in keys}, "process_mib": peak_rss_mib()}


def _print_partition(summary: dict, out: Any) -> None:
    """The partition's choice and why, and each part's time on each engine."""
    record = (summary.get("benchmark") or {}).get("partition") or (summary.get("parts") or {}).get(
        "placement"
    )
    if not record:
        return
    out.print(f"partition: {record['choice']} — {record.get('why', '')}", highlight=False,
              markup=False)  # fmt: skip
    if record.get("placement"):
        predicted = record.get("predicted_ms")
        measured = record.get("measured_ms")
        figures = "".join([
            f", predicted {predicted:.2f} ms" if predicted is not None else "",
            f", measured {measured:.2f} ms" if measured is not None else "",
        ])  # fmt: skip
        out.print(f"  placement {record['placement']}{figures}", highlight=False, markup=False)
    for part, times in (record.get("part_ms") or {}).items():
        shown = ", ".join(f"{engine} {ms:.2f} ms" for engine, ms in times.items())
        threads = (record.get("threads") or {}).get(part)  # none for a chain's segments
        shares = f" ({counted(threads, 'thread')})" if threads else ""
        out.print(f"  part {part}{shares}: {shown}", highlight=False,
                  markup=False)  # fmt: skip


def _tried_everything(config: Any) -> bool:
    """Whether every engine and every precision was tried: nothing left to suggest."""
    return config.engine == "auto" and config.precision == "auto"


def _pass_json(index: int, spec: Any) -> dict:
    """One pipeline step as `--show-pipeline --json` lists it."""
    engines = None if spec.engines is None else sorted(spec.engines)
    return {
        "index": index, "name": spec.name, "stage": spec.stage, "engines": engines,
        "doc": spec.doc,
    }  # fmt: skip


def _optimize_summary(artifact: Any, bench: dict | None, replaced: str) -> dict:
    manifest = artifact.manifest.to_json()
    return {
        "artifact": str(artifact.path),
        "replaced": bool(replaced),
        "replaced_what": replaced or None,  # artifact, directory or file
        "source": manifest["source"],
        "passes": manifest["passes"],
        "dropped_passes": manifest["dropped_passes"],
        "notes": manifest["notes"],
        "nodes": manifest["nodes"],
        "verification": manifest["verification"],
        "backend": manifest["backend"],
        "precision": manifest["precision"],
        "config": manifest["config"],
        "benchmark": bench,
        "parts": manifest.get("parts"),
    }
