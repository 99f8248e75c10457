"""The `kiln` command line. Every error the user can cause is one line and exit code 2."""

from __future__ import annotations

import json
import platform
import sys
from pathlib import Path
from typing import Annotated, Any

import numpy as np
import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from kiln import __version__
from kiln.errors import KilnError

app = typer.Typer(
    help="Kiln: compile, verify and benchmark neural-network models for this machine.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
zoo_app = typer.Typer(help="Built-in model architectures (seeded weights, authored in code).")
app.add_typer(zoo_app, name="zoo")
console = Console()
err = Console(stderr=True)

ModelArg = Annotated[str, typer.Argument(help="An .onnx file or zoo:NAME (see `kiln zoo list`).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of tables.")]


def _progress() -> Progress:
    # markup=False: descriptions hold user paths; disabled off a terminal, where a bar is
    # noise (and rich would leave a blank line on stderr).
    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}", markup=False),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    )


def _emit_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, default=float) + "\n")


# ---------------------------------------------------------------- zoo


@zoo_app.command("list")
def zoo_list(as_json: JsonOpt = False) -> None:
    """List the built-in models."""
    from kiln import zoo

    entries = [zoo.entry(n) for n in zoo.names()]
    if as_json:
        _emit_json(
            [{"name": e.name, "description": e.description, "tiny": e.tiny} for e in entries]
        )
        return
    table = Table("name", "description", title="Kiln model zoo")
    for e in entries:
        table.add_row(e.name, e.description)
    console.print(table)


@zoo_app.command("info")
def zoo_info(name: str, as_json: JsonOpt = False) -> None:
    """Show a zoo model's inputs, outputs, size, FLOPs and bytes against the published figure."""
    from kiln import zoo
    from kiln.cost import node_costs, total_cost, unknown_ops

    e = zoo.entry(name)
    model = zoo.build(name)
    costs = node_costs(model, e.dims)
    total = total_cost(costs.values())
    gflops = total.flops / 1e9  # every op counted; published figures count 2 × MACs only
    params = sum(int(np.prod(t.dims)) for t in model.graph.initializer)
    info = {
        "name": e.name,
        "description": e.description,
        "dims": e.dims,
        "parameters": params,
        "nodes": len(model.graph.node),
        "opset": next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")),
        "gflops": gflops,
        "mac_gflops": 2 * total.macs / 1e9,
        "gbytes": total.bytes / 1e9,
        "intensity": total.intensity,
        "unknown_ops": unknown_ops(costs),
        "published_gflops": e.published_gflops,
        "published_source": e.published_source,
        "deviation": (gflops / e.published_gflops - 1) if e.published_gflops else None,
        "inputs": [_value_info(v) for v in model.graph.input],
        "outputs": [_value_info(v) for v in model.graph.output],
    }
    if as_json:
        _emit_json(info)
        return
    table = Table(show_header=False, title=f"zoo:{e.name}")
    for key in ("description", "dims", "parameters", "nodes", "opset", "inputs", "outputs"):
        table.add_row(key, str(info[key]))
    table.add_row("GFLOPs (all ops)", f"{gflops:.3f}")
    table.add_row("GFLOPs (2×MAC)", f"{info['mac_gflops']:.3f}")
    table.add_row("GB moved", f"{info['gbytes']:.3f} (inputs, weights, outputs of every node)")
    table.add_row("intensity", f"{total.intensity:.1f} FLOP/byte")
    if info["unknown_ops"]:
        table.add_row("not costed", ", ".join(info["unknown_ops"]))
    if e.published_gflops:
        table.add_row("published", f"{e.published_gflops:.3f} ({e.published_source})")
        table.add_row("deviation", f"{info['deviation']:+.2%}")
    console.print(table)


def _value_info(v) -> str:
    dims = [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
    import onnx

    return f"{v.name}: {onnx.helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type)}{dims}"


@zoo_app.command("export")
def zoo_export(
    name: str,
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the .onnx file.")],
) -> None:
    """Write a zoo model to an ONNX file (external data beside it when large)."""
    import onnx

    from kiln import zoo

    model = zoo.build(name)
    large = model.ByteSize() > (1 << 30)
    onnx.save(model, str(output), save_as_external_data=large, location=output.name + ".data")
    console.print(f"wrote {output}")


# ---------------------------------------------------------------- optimize


@app.command()
def optimize(
    model: Annotated[
        str | None, typer.Argument(help="An .onnx file or zoo:NAME (see `kiln zoo list`).")
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
    rounds: Annotated[int, typer.Option(help="Interleaved timing rounds (0: no timing).")] = 5,
    runs: Annotated[int, typer.Option(help="Runs per engine per round.")] = 10,
    as_json: JsonOpt = False,
) -> None:
    """Compile MODEL into a verified artifact and time it against ONNX Runtime as-is.

    Lossless by default: outputs match the original within fp32 tolerance, checked on
    reference inputs. A pass that breaks the outputs is found by bisection and dropped.
    """
    from kiln.passes import default_pipeline, format_pipeline

    pipeline = default_pipeline()
    known = {s.name for s in pipeline}
    for name in skip:
        if name not in known:
            raise KilnError(f"unknown pass '{name}' in --skip-pass; see --show-pipeline.")
    pipeline = [s for s in pipeline if s.name not in skip]
    if show_pipeline:
        console.print(format_pipeline(pipeline), highlight=False, markup=False)
        return
    if model is None:
        raise KilnError("kiln optimize needs a MODEL: an .onnx file or zoo:NAME.")
    from kiln.artifact import check_destination
    from kiln.compiler import destination_for, optimize_model, save_result
    from kiln.ir import load_model
    from kiln.ir.inputs import parse_shapes

    candidates = _candidates(backend, precision, rounds)
    accuracy = _precision_options(metric, max_drop, calib, calib_method, block_size)
    with _progress() as progress:
        task = progress.add_task(f"loading {model}")
        say = lambda msg: progress.update(task, description=msg)  # noqa: E731
        loaded = load_model(model)
        check_destination(destination_for(loaded, output))
        results = [
            optimize_model(
                loaded,
                pipeline=[s for s in pipeline if s.engines is None or engine in s.engines],
                # (int8 narrows this further itself)
                inputs=inputs,
                shapes=parse_shapes(shape),
                verify=not no_verify,
                backend=engine,
                precision=level,
                progress=say,
                precision_options=accuracy,
            )
            for engine, level in candidates
        ]
        verified = [r for r in results if r.verification is None or r.verification.ok]
        result, bench = (verified or results)[0], None
        if rounds > 0 and verified:
            from kiln.bench.report import time_candidates

            timing = time_candidates(verified, rounds, runs, say)
            result, bench = _fastest(verified, timing)
            bench["refused"] = {
                label(r): r.verification.summary() for r in results if r not in verified
            }
        say("writing the artifact")
        artifact = save_result(result, output, benchmark=bench)
    summary = _optimize_summary(result, artifact, bench)
    if as_json:
        _emit_json(summary)
    else:
        _print_optimize(summary)


def _precision_options(
    metric: str, max_drop: float, calib: str | None, method: str, block_size: int
) -> Any:
    from kiln.backends.ort_quant import CALIBRATION_METHODS
    from kiln.compiler import PrecisionOptions
    from kiln.verify import budget_for

    if method not in CALIBRATION_METHODS:
        raise KilnError(
            f"unknown --calib-method '{method}'; use one of {', '.join(CALIBRATION_METHODS)}."
        )
    if block_size < 16 or block_size & (block_size - 1):
        raise KilnError(f"--block-size {block_size}: use a power of two ≥ 16, e.g. 32 or 128.")
    return PrecisionOptions(budget_for(metric, max_drop), calib, method, block_size)


def _candidates(backend: str, precision: str, rounds: int) -> list[tuple[str, str]]:
    """(engine, precision) pairs to build: one, or every installed engine (`--backend auto`)
    for every precision it runs (`--precision auto`)."""
    from kiln.backends import BACKENDS, available_backends, get_backend
    from kiln.compiler import PRECISIONS, check_precision

    levels = list(PRECISIONS) if precision == "auto" else [precision]
    if "auto" in (backend, precision) and rounds <= 0:
        raise KilnError("auto picks the fastest candidate by timing; use --rounds > 0.")
    if backend == "auto":
        engines = available_backends()
    elif backend not in BACKENDS:
        raise KilnError(f"unknown backend '{backend}'; use one of {', '.join(BACKENDS)} or auto.")
    else:
        get_backend(backend)  # fails now, with its reason, if the engine is missing
        engines = [backend]
    pairs = [(e, p) for p in levels for e in engines if e in PRECISIONS.get(p, ())]
    if not pairs:
        check_precision(engines[0] if engines else backend, precision)
        raise KilnError(f"no installed engine runs {precision}; install openvino.")
    return pairs


def label(result: Any) -> str:
    return f"{result.backend}/{result.precision}"


def _fastest(results: list, timing: dict) -> tuple[Any, dict]:
    """The verified candidate with the best median speedup."""
    candidates = timing["candidates"]
    best = max(results, key=lambda r: candidates[label(r)]["speedup"])
    bench = {
        "rounds": timing["rounds"],
        "runs_per_round": timing["runs_per_round"],
        "original_ort": timing["original_ort"],
        "artifact": candidates[label(best)],
        "speedup": candidates[label(best)]["speedup"],
        "choice": label(best),
        "candidates": {name: c["speedup"] for name, c in candidates.items()},
    }
    return best, bench


def _optimize_summary(result, artifact, bench) -> dict:
    manifest = artifact.manifest
    return {
        "artifact": str(artifact.path),
        "source": manifest["source"],
        "passes": manifest["passes"],
        "dropped_passes": manifest["dropped_passes"],
        "nodes": manifest["nodes"],
        "verification": manifest["verification"],
        "backend": manifest["backend"],
        "precision": manifest["precision"],
        "benchmark": bench,
    }


def _print_optimize(summary: dict) -> None:
    table = Table(title=f"kiln optimize → {summary['artifact']}", show_header=True)
    table.add_column("what")
    table.add_column("result", overflow="fold")
    rewrites: dict[str, int] = {}
    for p in summary["passes"]:  # simplify and refine-shapes run several times
        rewrites[p["name"]] = rewrites.get(p["name"], 0) + p["rewrites"]
    for name, count in rewrites.items():
        if count:
            table.add_row(f"pass {name}", f"{count} rewrites")
    for name in summary["dropped_passes"]:
        table.add_row(f"pass {name}", "[red]dropped: it broke the outputs or crashed[/red]")
    nodes = summary["nodes"]
    table.add_row("nodes", f"{nodes['before']} → {nodes['after']}")
    table.add_row("backend", escape(summary["backend"]["name"]))
    precision = summary["precision"]
    nodes = precision.get("nodes", {})
    kept = {n: p.split(" ")[0] for n, p in nodes.items() if not p.startswith(precision["default"])}
    if precision["default"] != "fp32":
        shown = ", ".join(f"{n} ({p})" for n, p in list(kept.items())[:12])
        more = f" and {len(kept) - 12} more (see manifest.json)" if len(kept) > 12 else ""
        table.add_row(
            "precision",
            escape(f"{precision['default']} ({precision.get('scheme', '')}); kept higher: ")
            + escape((shown or "none") + more),
        )
    warning = (precision.get("calibration") or {}).get("warning")
    if warning:
        table.add_row("[yellow]warning[/yellow]", f"[yellow]{escape(warning)}[/yellow]")
    verification = summary["verification"]
    if verification is None:
        table.add_row("verification", "[yellow]skipped (--no-verify)[/yellow]")
    else:
        table.add_row(
            "verification",
            ("[green]passed[/green]" if verification["ok"] else "[red]FAILED[/red]")
            + escape(f" ({verification['precision']}, inputs: {verification['inputs']})"),
        )
        if verification.get("metric"):
            table.add_row(
                "  accuracy budget",
                escape(
                    f"{verification['metric']} {verification['score']:.5f} ≥ "
                    f"{verification['threshold']:.5f} (worst held-out sample)"
                ),
            )
        for o in verification["outputs"]:
            if o.get("cosine") is not None:
                text = f"cosine {o['cosine']:.5f}, max abs {o['max_abs']:.1e}"
            else:
                text = f"max abs {o['max_abs']:.1e} ≤ {o['bound']:.1e}, max rel {o['max_rel']:.1e}"
            table.add_row(f"  output {o['name']}", text)
    bench = summary["benchmark"]
    if bench:
        for key, label in (("original_ort", "original, ORT_ENABLE_ALL"), ("artifact", "artifact")):
            s = bench[key]
            table.add_row(
                label,
                f"P50 {s['p50_ms']:.2f} ms  P99 {s['p99_ms']:.2f} ms  jitter {s['jitter']:.2f}",
            )
        table.add_row(
            "speedup",
            f"{bench['speedup']:.2f}× (median of {bench['rounds']} per-round P50 ratios)",
        )
        if len(bench["candidates"]) > 1:
            table.add_row(
                "candidates",
                ", ".join(f"{k} {v:.2f}×" for k, v in bench["candidates"].items()),
            )
        for name, why in bench.get("refused", {}).items():
            table.add_row(f"[yellow]refused {name}[/yellow]", escape(why))
    console.print(table)


# ---------------------------------------------------------------- run


@app.command()
def run(
    artifact: Annotated[Path, typer.Argument(help="A NAME.kiln artifact directory.")],
    inputs: Annotated[Path, typer.Option("--inputs", help=".npz with one array per input.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write outputs (.npz).")],
) -> None:
    """Run an artifact on inputs from an .npz file and write its outputs to another."""
    from kiln.ir.inputs import read_inputs
    from kiln.runtime import Session

    session = Session(artifact)
    feeds = read_inputs(str(inputs), session._interface)
    outputs = session.run(None, feeds)
    if not output.absolute().parent.is_dir():
        raise KilnError(f"{output}: the directory {output.absolute().parent} does not exist.")
    tmp = output.with_name(output.name + ".tmp.npz")
    try:
        np.savez(tmp, **dict(zip(session.output_names, outputs, strict=True)))
        tmp.replace(output)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise KilnError(f"{output}: could not write the outputs ({exc.strerror or exc}).") from None
    console.print(f"wrote {len(outputs)} outputs to {output}")


# ---------------------------------------------------------------- bench


@app.command()
def bench(
    model: Annotated[str, typer.Argument(help="An .onnx file, zoo:NAME, or a NAME.kiln artifact.")],
    against: Annotated[
        str,
        typer.Option(
            help="Comma-separated engines: ort, ort-basic, ort-transformers, ort-int8, openvino, "
            "openvino-bf16, openvino-int8 (the int8 ones: each tool's defaults, calibrated on "
            "--calib or on synthetic samples)."
        ),
    ] = "ort,ort-basic",
    batch: Annotated[int, typer.Option(help="Batch size of the synthesized inputs.")] = 1,
    inputs: Annotated[
        str | None,
        typer.Option(help="Time and measure drift on these inputs (.npz) instead of synthetic."),
    ] = None,
    calib: Annotated[
        str | None,
        typer.Option(help="Calibration samples (.npz or directory) for the int8 engines."),
    ] = None,
    shape: Annotated[
        list[str], typer.Option("--shape", help="INPUT=D0xD1x... for a synthesized input.")
    ] = [],  # noqa: B006
    rounds: Annotated[int, typer.Option(help="Interleaved rounds.")] = 5,
    runs: Annotated[int, typer.Option(help="Runs per engine per round.")] = 20,
    output: Annotated[
        Path | None, typer.Option("-o", "--output", help="Also write the results as JSON here.")
    ] = None,
    as_json: JsonOpt = False,
) -> None:
    """Kiln against other engines, interleaved in one process: P50/P90/P99, jitter, throughput.

    Speedups are medians of per-round P50 ratios against the first engine in --against.
    """
    from kiln.bench.report import run_bench
    from kiln.ir.inputs import parse_shapes

    with _progress() as progress:
        task = progress.add_task("preparing")
        say = lambda msg: progress.update(task, description=msg)  # noqa: E731
        result = run_bench(
            model, against, batch, rounds, runs, say, " ".join(sys.argv), parse_shapes(shape),
            inputs=inputs, calib=calib,
        )  # fmt: skip
    if output:
        output.write_text(json.dumps(result, indent=2) + "\n")
    if as_json:
        _emit_json(result)
        return
    from kiln.bench.report import print_bench

    print_bench(result, console)


# ---------------------------------------------------------------- doctor


@app.command()
def doctor(
    as_json: JsonOpt = False,
    refresh: Annotated[
        bool, typer.Option("--refresh", help="Measure the peaks again instead of the cache.")
    ] = False,
) -> None:
    """Python, Kiln and engine versions; CPU model, ISA features, cores and measured peaks."""
    from kiln.backends import BACKENDS
    from kiln.hardware import cpu_info, measured_peaks

    cpu = cpu_info()
    engines = {}
    for name, cls in BACKENDS.items():
        backend = cls()
        engines[name] = backend.describe() if backend.available() else {"available": "no"}
    # Measured once per machine (a few seconds), then read from the cache.
    with _progress() as progress:
        task = progress.add_task("peaks", total=None)

        def step(name: str) -> None:
            progress.update(task, description=f"measuring peaks: {name}")

        peaks = measured_peaks(refresh, progress=step)
    info = {
        "python": platform.python_version(),
        "kiln": __version__,
        "platform": platform.platform(),
        "cpu": cpu.to_json(),
        "hardware_fingerprint": cpu.fingerprint,
        "engines": engines,
        "peaks": peaks.to_json(),
    }
    if as_json:
        _emit_json(info)
        return
    table = Table(show_header=False, title="kiln doctor")
    table.add_row("python", info["python"])
    table.add_row("kiln", __version__)
    table.add_row("platform", info["platform"])
    table.add_row("cpu", cpu.model)
    table.add_row("cores", f"{cpu.physical_cores} physical, {cpu.logical_cores} logical")
    table.add_row("ISA features", " ".join(cpu.features) or "(none of interest)")
    for name, desc in engines.items():
        table.add_row(f"engine {name}", " ".join(f"{k}={v}" for k, v in desc.items()))
    none = "(no kernels here)"
    table.add_row("peak fp32", f"{peaks.fp32_gflops:,.0f} GFLOP/s (GEMM, {peaks.threads} threads)")
    table.add_row("peak bf16", f"{peaks.bf16_gflops:,.0f} GFLOP/s" if peaks.bf16_gflops else none)
    table.add_row("peak int8", f"{peaks.int8_gops:,.0f} GOP/s" if peaks.int8_gops else none)
    table.add_row("memory bandwidth", f"{peaks.bandwidth_gbs:,.1f} GB/s")
    when = f"{peaks.measured_at} (kiln doctor --refresh re-measures)"
    if peaks.load_average is not None and peaks.load_average > 0.5 * cpu.logical_cores:
        when += f"; the machine was busy (load {peaks.load_average:.1f}): peaks may be low"
    table.add_row("peaks measured", when)
    console.print(table)


# -------------------------------------------------------- verbs defined beside their package
# (each module keeps its heavy imports inside the command, so `kiln --help` stays fast)
from kiln.profile.command import profile  # noqa: E402
from kiln.serve.command import serve  # noqa: E402

app.command()(serve)
app.command()(profile)


def main() -> None:
    from rich.text import Text

    try:
        app()
    except KilnError as exc:
        # A Text, not markup: paths and messages may hold '[...]' or ':name:'. soft_wrap keeps
        # the message on one line whatever the terminal's width.
        line = Text.assemble(("error:", "bold red"), " ", " ".join(str(exc).splitlines()))
        err.print(line, highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        err.print("interrupted; nothing was written.")
        sys.exit(130)
