"""`kiln optimize`: compile a model into a verified artifact, timed against ONNX Runtime."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from kiln.cli.console import JsonOpt, at_least, console, emit_json, progress, speed_advice
from kiln.errors import KilnError, counted


def optimize(
    model: Annotated[
        str | None,
        typer.Argument(
            help="An .onnx file, a .pt2 saved by torch.export.save (needs PyTorch; verified "
            "against the program's own outputs on its saved example inputs), or zoo:NAME (see "
            "`kiln zoo list`)."
        ),
    ] = None,
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="Artifact directory (NAME.kiln).")
    ] = None,
    inputs: Annotated[
        str | None, typer.Option("--inputs", help="Reference inputs (.npz) for verification.")
    ] = None,
    shape: Annotated[
        list[str],
        typer.Option(
            "--shape",
            help="Shape of a synthesized input, INPUT=D0xD1x... (repeatable), for dynamic dims "
            "Kiln cannot guess.",
        ),
    ] = [],  # noqa: B006
    backend: Annotated[
        str,
        typer.Option(
            help="Engine the artifact runs on: ort, openvino, or auto (build, verify and time "
            "each installed engine; keep the fastest)."
        ),
    ] = "ort",
    precision: Annotated[
        str,
        typer.Option(
            help="fp32 (lossless, the default); bf16 (OpenVINO), int8 (ONNX Runtime; OpenVINO "
            "through NNCF) or int4 (ONNX Runtime, MatMul weights), each under an accuracy guard "
            "that keeps the most sensitive layers in fp32 until --metric is within --max-drop of "
            "fp32; or auto: every precision on every engine that runs it, the fastest within "
            "budget kept."
        ),
    ] = "fp32",
    metric: Annotated[
        str,
        typer.Option(
            help="Accuracy metric for lower precisions: cosine, top1 (argmax agreement), max-abs "
            "(relative to the output's scale), or module:function(outputs_ref, outputs_new) -> "
            "float, higher is better."
        ),
    ] = "cosine",
    max_drop: Annotated[
        float,
        typer.Option(help="How far the metric may fall below fp32's, relative (0.01 = 1 %)."),
    ] = 0.01,
    calib: Annotated[
        str | None,
        typer.Option(
            help="Calibration samples for static int8: an .npz (arrays stacked on a first "
            "sample axis, or one sample) or a directory of them. Without --inputs a quarter is "
            "held out to judge accuracy. Without --calib Kiln calibrates on synthetic inputs "
            "and says so."
        ),
    ] = None,
    calib_method: Annotated[
        str, typer.Option(help="ONNX Runtime calibration: minmax, entropy or percentile.")
    ] = "minmax",
    block_size: Annotated[int, typer.Option(help="int4: weights per quantization block.")] = 32,
    no_verify: Annotated[bool, typer.Option("--no-verify", help="Skip verification.")] = False,
    skip: Annotated[
        list[str], typer.Option("--skip-pass", help="Leave this pass out (repeatable).")
    ] = [],  # noqa: B006
    show_pipeline: Annotated[
        bool, typer.Option("--show-pipeline", help="Print the pass pipeline and exit.")
    ] = False,
    config_file: Annotated[
        Path | None,
        typer.Option(
            "--config",
            help="Rebuild from a recorded CompileConfig: an artifact's manifest.json (or the "
            "artifact directory, or a bare config JSON). MODEL defaults to the artifact's source "
            "model; the config fixes every compile decision, so other compile flags are refused.",
        ),
    ] = None,
    force: Annotated[
        bool,
        typer.Option(
            "--force",
            help="Replace whatever is at -o. Without it only a Kiln artifact holding nothing "
            "but its own files is replaced.",
        ),
    ] = False,
    rounds: Annotated[
        int,
        typer.Option(
            help="Interleaved timing rounds (0: no timing; 3 or more to tell a speedup from noise)."
        ),
    ] = 5,
    runs: Annotated[int, typer.Option(help="Runs per engine per round.")] = 10,
    max_memory: Annotated[
        str | None,
        typer.Option(
            "--max-memory",
            help="The artifact's peak resident memory must fit, e.g. 1.5GB or 800MiB: measured "
            "as a kiln.Session of it opened and run in a process of its own. Over it, the "
            "engine's memory-saving options are tried, cheapest in time first (ONNX Runtime: "
            "arena grown as requested, no memory pattern, no weight prepacking); the manifest "
            "records each one's peak and latency. Nothing fits: an error, nothing written.",
        ),
    ] = None,
    partition: Annotated[
        str,
        typer.Option(
            "--partition",
            help="none (one part); auto: the model's independent branches (e.g. a two-tower "
            "model's image and text towers) and their join as parts, each on the installed "
            "engine measured fastest for it, run at once on shares of the cores — or, for a "
            "chain of layers, its segments (cut where one tensor carries everything on) each on "
            "the engine Kiln's build of it runs fastest, neighbours on one engine one part; kept "
            "only when clearly faster than the best single-engine build (in every timing round, "
            "or 1.05x in the median with two rounds in three). Or a placement "
            "PART=ENGINE[:PRECISION],... e.g. image=openvino,text=ort, or for a chain "
            "s01=openvino,s03=openvino (the segments' sNN; an unknown one lists them).",
        ),
    ] = "none",
    static: Annotated[
        bool,
        typer.Option(
            "--static",
            help="OpenVINO: compile for the dims of the inputs verified on (static shapes ran "
            "BERT at batch 8 1.4x faster on one Xeon, 0.95-1.04x on other CPUs: time it); a "
            "run at other dims compiles the dynamic model on first use. With --backend auto, "
            "for the OpenVINO candidates only; --backend auto with --shape given "
            "already times each fp32/bf16 OpenVINO candidate both ways (bert-base-4k at 4,096: "
            "static 1.09x).",
        ),
    ] = False,
    memory: Annotated[
        bool | None,
        typer.Option(
            "--memory/--no-memory",
            help="Measure the artifact's peak resident memory (opened and run 10 times in a "
            "process of its own, seconds) into the JSON and the manifest's benchmark, beside "
            "this compile's own peak. Default: on for models with 64 MiB of weights or more.",
        ),
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Compile MODEL into a verified artifact and time it against ONNX Runtime as-is.

    Lossless by default: outputs match the original within fp32 tolerance, checked on
    reference inputs. A pass that breaks the outputs is found by bisection and dropped. The
    speedup comes with its spread over rounds and a verdict (faster, no different within
    noise, slower); --backend auto --precision auto tries every engine and precision.
    """
    from kiln.passes import default_pipeline, format_pipeline
    from kiln.report.terminal import print_optimize

    at_least(rounds=(rounds, 0), runs=(runs, 1), block_size=(block_size, 1))
    pipeline = default_pipeline()
    known = {s.name for s in pipeline}
    for name in skip:
        if name not in known:
            raise KilnError(f"unknown pass '{name}' in --skip-pass; see --show-pipeline.")
    pipeline = [s for s in pipeline if s.name not in skip]
    if show_pipeline:
        if as_json:
            emit_json([_pass_json(i, spec) for i, spec in enumerate(pipeline, 1)])
        else:
            console.print(format_pipeline(pipeline), highlight=False, markup=False)
        return
    from kiln.artifact.store import check_destination, replaces_existing
    from kiln.compiler import CompileConfig, build, candidates, save_result
    from kiln.compiler.api import load_source
    from kiln.config import read_config
    from kiln.ir.inputs import parse_shapes

    given = {
        "backend": backend != "ort", "precision": precision != "fp32", "metric": metric != "cosine",
        "max-drop": max_drop != 0.01, "calib": calib is not None,
        "calib-method": calib_method != "minmax", "block-size": block_size != 32,
        "inputs": inputs is not None, "shape": bool(shape), "no-verify": no_verify,
        "skip-pass": bool(skip), "max-memory": max_memory is not None,
        "partition": partition != "none", "static": static,
    }  # fmt: skip
    if config_file is not None:
        flags = [f"--{name}" for name, set_ in given.items() if set_]
        if flags:
            raise KilnError(
                f"--config fixes every compile decision; drop {', '.join(flags)} or edit the "
                "config's JSON."
            )
        config, source = read_config(config_file)
        model = model or source
    else:
        config = CompileConfig(
            engine=backend,
            precision=precision,
            # the engines' own default pipelines unless a pass is skipped (each candidate keeps
            # the passes its engine runs; int8 narrows this further itself)
            pipeline=tuple(s.name for s in pipeline) if skip else None,
            metric=metric,
            max_drop=max_drop,
            calib=calib,
            calib_method=calib_method,
            block_size=block_size,
            inputs=inputs,
            shapes=parse_shapes(shape),
            verify=not no_verify,
            partition=partition,
            static=static,
        )
    if model is None:
        raise KilnError("kiln optimize needs a MODEL: an .onnx file or zoo:NAME.")
    if config.is_auto and rounds <= 0:
        raise KilnError("auto picks the fastest candidate by timing; use --rounds > 0.")
    budget = _memory_budget(max_memory, rounds)
    if budget is not None and config.partition != "none":
        raise KilnError("--max-memory measures one engine's artifact; use --partition none.")
    candidates(config)  # a missing engine or an unsupported precision fails before loading
    if output is not None:
        check_destination(output, force)  # before loading: a bad -o costs nothing
    with progress() as bar:
        task = bar.add_task(f"loading {model}")
        say = lambda msg: bar.update(task, description=msg)  # noqa: E731
        loaded = load_source(model)
        destination = output or Path(f"{loaded.name}.kiln")
        check_destination(destination, force)
        replaced = replaces_existing(destination)
        fit = None
        if budget is not None:
            from kiln.compiler.memory import fit_candidates

            fit = lambda results: fit_candidates(  # noqa: E731
                results, budget, _measure_memory, rounds=rounds, runs=runs, say=say
            )
        if config.partition != "none":
            artifact, bench = _partitioned(loaded, config, destination, rounds, runs, say, force)
        else:
            result, bench = build(loaded, config, rounds=rounds, runs=runs, progress=say, fit=fit)
            if bench is not None and budget is None and _measures_memory(memory, result):
                say("measuring the artifact's peak resident memory (a process of its own)")
                bench["peak_rss_mib"] = _peak_rss(result)
            say("writing the artifact")
            artifact = save_result(result, destination, bench, force=force)
    summary = _optimize_summary(artifact, bench, replaced)
    verdict = bench.get("verdict") if bench else None
    summary["advice"] = speed_advice(
        verdict, "the artifact", "ONNX Runtime as-is", model, auto=_tried_everything(config)
    )
    if as_json:
        emit_json(summary)
    else:
        print_optimize(summary, console)
        _print_partition(summary, console)


def _partitioned(
    loaded: Any, config: Any, destination: Path, rounds: int, runs: int, say: Any, force: bool
) -> tuple[Any, dict | None]:
    """--partition: the partitioned build (or the single part it lost to), written."""
    from kiln.compiler import save_result
    from kiln.compiler.partition import build_partitioned, save_chosen

    chosen, bench = build_partitioned(loaded, config, None, "", rounds=rounds, runs=runs, say=say)
    say("writing the artifact")
    return save_chosen(chosen, destination, bench, save_result, force), bench


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
        threads = (record.get("threads") or {}).get(part)
        out.print(f"  part {part} ({counted(threads, 'thread')}): {shown}", highlight=False,
                  markup=False)  # fmt: skip


def _memory_budget(text: str | None, rounds: int) -> float | None:
    """--max-memory in MiB (sizes as `kiln tune --max-memory` reads them), or None."""
    if text is None:
        return None
    from kiln.tune.objectives import parse_constraint

    if rounds <= 0:
        raise KilnError(
            "--max-memory times what each memory-saving option costs; use --rounds > 0."
        )
    bound = parse_constraint("max_memory", text).bound
    if bound <= 0:
        raise KilnError(f"--max-memory {text}: give a size above zero, e.g. 1.5GB.")
    return bound


def _measure_memory(result: Any) -> dict[str, float]:
    """A candidate's memory: saved, then opened as a kiln.Session and run in a process of its
    own on its reference inputs (`kiln.runtime.footprint.peak_memory`), in MiB."""
    import tempfile

    from kiln.compiler import save_result
    from kiln.runtime.footprint import peak_memory

    with tempfile.TemporaryDirectory(prefix="kiln-optimize-memory-") as where:
        path = save_result(result, Path(where) / "candidate.kiln").path
        feeds = result.feeds[0] if result.feeds else None
        measured = peak_memory(path, feeds, runs=10)
    return {k: measured[k] for k in ("peak_mib", "load_mib", "steady_mib")}


MEMORY_FROM_MIB = 64  # weights from which `kiln optimize` measures memory unless told


def _measures_memory(asked: bool | None, result: Any) -> bool:
    """--memory / --no-memory, else whether the weights are large enough for memory to count
    (and the seconds of a measuring process to be small beside the compile)."""
    if asked is not None:
        return asked
    from kiln.ir.weights import weight_bytes

    return weight_bytes(result.model) >= MEMORY_FROM_MIB * 2**20


def _peak_rss(result: Any) -> dict[str, float]:
    """`peak_rss_mib`, in MiB, the artifact's above an interpreter with its engine loaded (as
    `kiln bench` reports each engine's): "load" once open, "run" the high-water mark over
    opening and 10 runs, "steady" what it keeps after them; and "compile", this process's own
    high-water mark (the whole process: Kiln, both engines, the original and the candidates)."""
    from kiln.runtime.footprint import peak_rss_mib

    measured = _measure_memory(result)
    return {
        "load": round(measured["load_mib"], 1),
        "run": round(measured["peak_mib"], 1),
        "steady": round(measured["steady_mib"], 1),
        "compile": round(peak_rss_mib(), 1),
    }


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


def _optimize_summary(artifact: Any, bench: dict | None, replaced: bool) -> dict:
    manifest = artifact.manifest.to_json()
    return {
        "artifact": str(artifact.path),
        "replaced": replaced,
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
