"""`kiln optimize MODULE:FUNCTION --model NAME=PATH ... --data ...`: a pipeline compiled.

The flags `kiln optimize` shares with a one-model compile keep their meaning where it carries
over: --backend is each stage's engine (auto: the fastest per stage); --precision the lossy
precision tried per stage (fp32, the default: none; auto: every lossy precision this machine
runs, bf16 where OpenVINO computes it here, and int8), each judged on the pipeline's final
results and kept only where the stage runs faster with it;
--metric (exact unless given: cosine means nothing for a pipeline's results) and --max-drop
the end-to-end budget.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from kiln.cli.console import console, emit_json, progress, write_results
from kiln.config import CompileConfig
from kiln.errors import KilnError

ModelsOpt = Annotated[
    list[str],
    typer.Option(
        "--model",
        help="NAME=PATH: a model of the pipeline function MODEL (MODULE:FUNCTION), given to it "
        "as the keyword argument NAME; once per model.",
        rich_help_panel="Pipelines",
    ),
]
DataOpt = Annotated[
    str | None,
    typer.Option(
        "--data",
        help="A pipeline's data: a directory (each file's path handed to the function in "
        "turn) or MODULE:FUNCTION returning an iterable of inputs. The reference run over it "
        "records each model's real feeds (its calibration set and shapes) and judges every "
        "lossy choice on the pipeline's final results.",
        rich_help_panel="Pipelines",
    ),
]
StreamsOpt = Annotated[
    int,
    typer.Option(
        "--streams",
        help="How many streams the pipeline serves at once (recorded in the artifact: the "
        "count kiln profile runs it at unless told otherwise).",
        rich_help_panel="Pipelines",
    ),
]
StreamCountsOpt = Annotated[
    str,
    typer.Option(
        "--streams",
        help="A pipeline artifact's stream counts, e.g. 1,4,16: at each, every input of --data "
        "is answered with that many streams, each taking the next input when its last is "
        "answered (MLPerf's MultiStream rule), pre- and post-processing timed.",
        rich_help_panel="Pipelines",
    ),
]
PeerOpt = Annotated[
    str | None,
    typer.Option(
        "--against-pipeline",
        help="A peer pipeline to measure beside a pipeline artifact: MODULE:FUNCTION of one "
        "input, run with one thread per stream.",
        rich_help_panel="Pipelines",
    ),
]


def is_pipeline_call(model: str | None, models: list[str], data: str | None) -> bool:
    return bool(models) or data is not None


def optimize_pipeline(
    spec: str | None, models: list[str], data: str | None, streams: int,
    config: CompileConfig, output: Path | None, force: bool, as_json: bool,
) -> None:  # fmt: skip
    """Compile the pipeline and print what each stage's choice cost and won."""
    from kiln.pipeline import compile_pipeline, parse_models
    from kiln.pipeline.compile import lossy_precisions

    if not spec or ":" not in spec or spec.startswith("zoo:"):
        raise KilnError(
            "kiln optimize with --model compiles a pipeline: give its function as MODEL, "
            "MODULE:FUNCTION (e.g. ocr.py:read_text)."
        )
    if data is None:
        raise KilnError("a pipeline is recorded and judged on its data: give --data DIR or "
                        "--data MODULE:FUNCTION.")  # fmt: skip
    # The single-model default (cosine) stands for "not given": a pipeline's is exact. Given
    # by name it is refused as any other single-model metric is (load_metric).
    given = any(a == "--metric" or a.startswith("--metric=") for a in sys.argv)
    metric = "exact" if config.metric == CompileConfig().metric and not given else config.metric
    lossy = lossy_precisions(config.precision, config.engine)
    out = output or Path(f"{spec.rpartition(':')[2]}.kiln")
    with progress() as bar:
        task = bar.add_task(f"recording {spec}")
        path = compile_pipeline(
            spec, parse_models(models), data, out, metric=metric, max_drop=config.max_drop,
            backend=config.engine, precisions=lossy, streams=streams, force=force,
            say=lambda line: bar.update(task, description=line.strip()),
        )  # fmt: skip
    summary = pipeline_summary(json.loads((path / "pipeline.json").read_text()), path)
    if as_json:
        return emit_json(summary)
    _print(summary)


def pipeline_summary(manifest: dict[str, Any], path: Path) -> dict[str, Any]:
    reference = manifest["reference"]
    return {
        "artifact": str(path),
        "stages": {n: s["precision"] for n, s in manifest["stages"].items()},
        "engines": {n: s.get("engine", "") for n, s in manifest["stages"].items()},
        "metric": manifest["metric"],
        "reference": {k: reference[k] for k in ("inputs", "seconds", "model_seconds",
                                                 "glue_seconds", "calls")},
        "search": manifest["search"],
        "folds": manifest.get("folds", {}),
        "merging": manifest.get("merging", {}),
        "streams": manifest.get("streams", 1),
    }  # fmt: skip


def _print(summary: dict[str, Any]) -> None:
    from rich.table import Table

    reference, metric = summary["reference"], summary["metric"]
    table = Table(title=f"kiln optimize → {summary['artifact']}")
    columns = ("stage", "calls", "time (all calls)", "choice", "runs", "end-to-end trials")
    for column in columns:
        table.add_column(column)
    trials: dict[str, list[str]] = {}
    for t in summary["search"]["trials"]:
        verdict = "kept" if t["kept"] else f"rejected: {t['reason']}"
        trials.setdefault(t["stage"], []).append(
            f"{t['precision']}: {metric['name']} {t['metric']:.4g}; all calls "
            f"{t['baseline_ms']:.1f} → {t['stage_ms']:.1f} ms ({t['speedup']:.2f}×); {verdict}"
        )
    for name, choice in summary["stages"].items():
        spent = reference["model_seconds"].get(name, 0.0)
        refused = summary["search"]["space"][name]["refused"]
        notes = trials.get(name, []) + [f"{p}: not built: {why}" for p, why in refused.items()]
        calls = str(reference["calls"].get(name, 0))
        shown = "\n".join(notes) or "none tried"
        engine = summary.get("engines", {}).get(name)
        shown_choice = f"{choice} ({engine})" if engine else choice
        runs = _runs(summary["folds"].get(name, {}), summary["merging"].get(name))
        table.add_row(name, calls, f"{1e3 * spent:.1f} ms", shown_choice, runs, shown)
    table.caption = (
        f"{reference['inputs']} inputs; glue {1e3 * reference['glue_seconds']:.1f} ms; "
        f"{metric['name']} {metric['final']:.4g} against the fp32 pipeline's "
        f"{metric['reference']:.4g} (allowed drop {metric['max_drop']})"
    )
    console.print(table)


def _runs(fold: dict[str, Any], merging: dict[str, Any] | None) -> str:
    """How a stage runs: with the glue's Kiln ops folded in or not, and its calls from several
    streams merged into one run or each apart."""
    lines = [f"ops folded in ({fold['speedup']:.2f}×)"] if fold.get("kept") else []
    if merging is not None:
        lines.append("calls merged" if merging["merge"] else "calls apart")
    return "\n".join(lines) or "as compiled"


def bench_pipeline_verb(
    artifact: str, data: str | None, streams: str, against: str | None, output: Path | None,
    as_json: bool, rounds: int = 3,
) -> None:  # fmt: skip
    """`kiln bench` of a pipeline artifact: the MultiStream figures, printed or as JSON."""
    from kiln.pipeline.bench import bench_pipeline

    if data is None:
        raise KilnError(f"{artifact} is a pipeline: give the inputs to answer, --data DIR or "
                        "--data MODULE:FUNCTION.")  # fmt: skip
    counts = _counts(streams)
    with progress() as bar:
        task = bar.add_task(f"benchmarking {artifact}")
        result = bench_pipeline(artifact, data, counts, against, rounds=rounds,
                                say=lambda line: bar.update(task, description=line))  # fmt: skip
    write_results(output, result)
    if as_json:
        return emit_json(result)
    _print_bench(result)


def _counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise KilnError(f"--streams {text}: give stream counts of 1 or more, e.g. 1,4,16.")
    return counts


def _print_bench(result: dict[str, Any]) -> None:
    from rich.table import Table

    from kiln.timing import MIN_RUNS_FOR_P99

    table = Table(title=f"{result['queries']} queries per stream count, {result['rounds']} rounds "
                        f"(queries/s: the median round's, every round's in brackets); metric "
                        f"{result['metric']} against the fp32 pipeline")  # fmt: skip
    columns = ("streams", "way", "queries/s", "P50 ms", "P90 ms", "P99 ms (queries)", "metric",
               "kiln against")  # fmt: skip
    for column in columns:
        table.add_column(column)
    for n, ways in result["streams"].items():
        for way in ("kiln", "plain", "peer"):
            if way not in ways:
                continue
            w = ways[way]
            ratio = "" if way != "kiln" else _versus(ways, "plain")
            if way == "kiln" and "peer" in ways:
                ratio += "\n" + _versus(ways, "peer")
            rates = " ".join(f"{r:.2f}" for r in w["queries_per_s_rounds"])
            table.add_row(n, way, f"{w['queries_per_s']:.2f} ({rates})", f"{w['p50_ms']:.1f}",
                          f"{w['p90_ms']:.1f}", f"{w['p99_ms']:.1f} ({w['p99_backed_by']})",
                          f"{w['metric']:.4g}", ratio)  # fmt: skip
    table.caption = (f"A P99 over fewer than {MIN_RUNS_FOR_P99} queries is about their "
                     "maximum (MLPerf's rule); --json adds each stage's calls, executions, mean "
                     "batch and times (the last round's).")  # fmt: skip
    console.print(table)


def _versus(ways: dict[str, Any], other: str) -> str:
    """Kiln's queries/s over `other`'s, with the per-round range and verdict, and its P99's."""
    spread = ways[f"speedup_vs_{other}_spread"]
    verdict = ways[f"speedup_vs_{other}_verdict"]
    shown = (
        f" ({spread[0]:.2f}-{spread[1]:.2f}, {verdict})"
        if spread
        else " (spread unknown: fewer than 3 rounds)"
    )
    return (f"{ways[f'speedup_vs_{other}']:.2f}x {other}'s queries/s{shown}; its P99 "
            f"{ways[f'p99_vs_{other}']:.2f}x {other}'s")  # fmt: skip


PipelineStreamsOpt = Annotated[
    int | None,
    typer.Option(
        "--streams",
        help="A pipeline artifact's streams at once (default: the count it was compiled for).",
        rich_help_panel="Pipelines",
    ),
]


def _check_pipeline(artifact: str, data: str | None, verb: str) -> str:
    """The data of a pipeline verb, after the path and --data are checked."""
    from kiln.pipeline.pipeline_artifact import is_pipeline

    if not Path(artifact).exists():
        raise KilnError(f"{artifact}: no such file or directory.")
    if not is_pipeline(artifact):
        raise KilnError(f"{artifact} is not a pipeline artifact: --data and --streams are for "
                        f"one (kiln {verb} OUT.kiln --data ..., OUT.kiln from kiln optimize "
                        "MODULE:FUNCTION --model NAME=PATH ...).")  # fmt: skip
    if data is None:
        raise KilnError(f"{artifact} is a pipeline: give the inputs to run, --data DIR or "
                        "--data MODULE:FUNCTION.")  # fmt: skip
    return data


def profile_pipeline_verb(
    artifact: str, data: str | None, streams: int | None, trace: Path | None,
    output: Path | None, as_json: bool,
) -> None:  # fmt: skip
    """`kiln profile` of a pipeline artifact: each query split into glue, queueing and compute
    per stage, the stages' batching and the findings; a Perfetto trace with --trace."""
    from kiln.pipeline.profile import profile_pipeline

    data = _check_pipeline(artifact, data, "profile")
    if output is not None:
        raise KilnError(f"{artifact} is a pipeline: its profile is printed, or --json, and its "
                        "timeline written with --trace; drop -o.")  # fmt: skip
    with progress() as bar:
        task = bar.add_task(f"profiling {artifact}")
        result = profile_pipeline(artifact, data, streams, trace,
                                  say=lambda line: bar.update(task, description=line))  # fmt: skip
    if as_json:
        return emit_json(result)
    _print_profile(result)
    if trace is not None:
        console.print(f"wrote trace {trace}", highlight=False, markup=False)


def _print_profile(result: dict[str, Any]) -> None:
    from rich.table import Table

    query = result["query"]
    table = Table(title=f"{result['queries']} queries on {result['streams']} streams: median "
                        f"{query['median_ms']:.2f} ms, P99 {query['p99_ms']:.2f} ms, "
                        f"{result['queries_per_s']:.2f} queries/s")  # fmt: skip
    for column in ("part", "median ms", "total ms", "share", "calls", "mean batch"):
        table.add_column(column)
    glue = result["split"]["glue"]
    table.add_row("glue", f"{glue['median_ms']:.3f}", f"{glue['total_ms']:.1f}",
                  f"{glue['share']:.0%}", "", "")  # fmt: skip
    for name, parts in result["split"]["stages"].items():
        stage = result["stages"][name]
        for part, figures in parts.items():
            table.add_row(f"{name} {part}", f"{figures['median_ms']:.3f}",
                          f"{figures['total_ms']:.1f}", f"{figures['share']:.0%}",
                          str(stage["calls"]), f"{stage['mean_batch']:.2f}")  # fmt: skip
    console.print(table)
    for line in result["findings"]:
        console.print(f"• {line}", highlight=False, markup=False)


def compare_pipeline_verb(
    artifact: str, other: str | None, data: str | None, metric: str, as_json: bool
) -> None:
    """`kiln compare` of a pipeline artifact: which stage's choice changed the output."""
    from kiln.pipeline.compare import compare_pipeline
    from kiln.pipeline.pipeline_artifact import is_pipeline

    if other is None and data is None and not is_pipeline(artifact):
        raise KilnError("kiln compare needs B, what is compared with A (or A a pipeline artifact "
                        "with --data).")  # fmt: skip
    data = _check_pipeline(artifact, data, "compare")
    if other is not None:
        raise KilnError(f"{artifact} is a pipeline: it is compared with its own fp32 sources; "
                        f"drop {other}.")  # fmt: skip
    chosen = None if metric == "auto" else metric
    with progress() as bar:
        task = bar.add_task(f"comparing {artifact}")
        result = compare_pipeline(artifact, data, chosen,
                                  say=lambda line: bar.update(task, description=line))  # fmt: skip
    if as_json:
        return emit_json(result)
    from rich.table import Table

    table = Table(title=f"{result['metric']} against the fp32 pipeline: {result['chosen']:.4g} "
                        f"with every choice, over {result['inputs']} inputs")  # fmt: skip
    for column in ("stage", "choice", "metric with it at fp32", "results it changes",
                   "first, its outputs' largest difference"):  # fmt: skip
        table.add_column(column)
    for name, s in result["stages"].items():
        first = "\n".join(f"input {f['input']}: {_difference(f['max_abs_diff'])}"
                          for f in s["first"])  # fmt: skip
        table.add_row(name, s["precision"], f"{s['metric_with_it_at_fp32']:.4g}",
                      str(s["changed"]), first)  # fmt: skip
    console.print(table)
    console.print(result["verdict"], highlight=False, markup=False)


def _difference(value: float | None) -> str:
    return "outputs of another shape" if value is None else f"{value:.3g}"
