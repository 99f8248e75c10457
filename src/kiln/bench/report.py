"""`kiln bench`: build the engines, time them interleaved, and report every figure."""

from __future__ import annotations

import datetime as dt
import math
import platform
import statistics
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx_ir as ir

from kiln import __version__
from kiln.bench.engines import CALIBRATION_SAMPLES, ENGINES, engine_runner, parse_engines
from kiln.errors import KilnError
from kiln.hardware import FloorSampler, JitterFloor, Peaks, cpu_info
from kiln.hardware.jitter import FLOOR_RUNS, PARALLEL_PROBE, TARGET_SECONDS
from kiln.ir.inputs import default_dims, feed_dims, synthesize
from kiln.timing import (
    BOOTSTRAP_RESAMPLES,
    MIN_RUNS_FOR_P99,
    Speedup,
    cqi,
    interleave,
    jitter_ratio_interval,
    p99_backing,
    round_stats,
    speedups,
    tail_interval,
    time_runs,
)

# The floor probes' run, bounded: below a millisecond the clock's own cost shows; above a
# quarter second 1,000 probe runs would outlast the engines' timing.
FLOOR_SCALE_S = (TARGET_SECONDS, 0.25)
# The precision whose peak an engine's achieved FLOP/s is held to (the rest: fp32). The int8
# engines keep some nodes in fp32, but their matrix products, the FLOPs counted, are int8.
ENGINE_PRECISION = {"openvino-bf16": "bf16", "ort-int8": "int8", "openvino-int8": "int8"}


def _kiln_runner(
    model: str, say: Callable[[str], None], shapes: dict | None = None, backend: str = "ort"
):
    """The original model, the Kiln engine (from an artifact, or compiled here in memory) and
    what that engine is: its source model and whether `--backend/--precision auto` chose it."""
    from kiln.backends import get_backend
    from kiln.compiler import CompileConfig, build
    from kiln.compiler.api import load_source

    if Path(model).is_dir():
        from kiln.runtime import Session

        session = Session(model)  # a partitioned artifact: its parts, as kiln.Session runs them
        source = session.artifact.manifest.source.path
        try:
            original = load_source(source).model  # an .onnx, zoo:NAME or .pt2 program
        except KilnError as exc:
            raise KilnError(
                f"{model}: bench compares against the original model, {source}, which "
                f"cannot be loaded ({exc})"
            ) from None
        timing = session.artifact.manifest.benchmark or {}
        built = {"source": source, "auto": len(timing.get("candidates", {})) > 1}
        built["dims"] = session.artifact.manifest.dims
        built["precision"] = session.artifact.manifest.precision.get("default", "fp32")
        return original, lambda feeds: lambda: session.run(None, feeds), built, lambda _: model
    say(f"compiling {model}")
    config = CompileConfig(engine=backend, shapes=shapes or {})
    result, _ = build(load_source(model), config, progress=say)
    exe = get_backend(backend).compile(result.model, result.options)
    built = {"source": model, "auto": False, "precision": result.precision}

    def artifact(where: Path) -> str:  # what the memory child opens: the build, saved
        from kiln.compiler import save_result

        return str(save_result(result, where / "kiln.kiln").path)

    return result.loaded.model, lambda feeds: lambda: exe.run(feeds), built, artifact


def run_bench(
    model: str,
    against: str,
    batch: int,
    rounds: int,
    runs: int,
    say: Callable[[str], None],
    command: str = "",
    shapes: dict | None = None,
    backend: str = "ort",
    inputs: str | None = None,
    calib: str | None = None,
    memory: bool = True,
) -> dict:
    """Every engine timed interleaved, with its drift from fp32 and (`memory`) its resident
    memory measured in a process of its own."""
    engines = parse_engines(against)
    original, kiln_for, built, kiln_artifact = _kiln_runner(model, say, shapes, backend)
    dims = {**default_dims(original), **built.pop("dims", {})}  # an artifact's fitted dims
    dims |= dict.fromkeys(_leading_dims(original), batch)
    feeds, calibration, batch = _feeds(original, dims, shapes, inputs, calib, engines, batch, say)
    runners = {}
    for name in engines:
        say(f"preparing engine {name}")
        runners[name] = engine_runner(name, original, feeds, calibration)
    runners["kiln"] = kiln_for(feeds)
    say("measuring each engine's drift from the fp32 original")
    drift = _drift(runners, engine_runner("ort-basic", original, feeds)())
    flops, peaks, roof_note = _roofs(original, feeds, say)
    samples, measured_floor = _timed_with_floor(runners, rounds, runs, say)
    baseline = engines[0] if engines else "kiln"
    compared = speedups(samples, baseline)
    precisions = {name: ENGINE_PRECISION.get(name, "fp32") for name in engines}
    precisions["kiln"] = built.get("precision", "fp32")
    resident = {}
    if memory:  # after the timing, which no child process may disturb
        resident = _memory(engines, original, feeds, calibration, kiln_artifact, say)
    cpu = cpu_info()
    return {
        "command": command,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "model": model,
        "batch": batch,
        "inputs": inputs or "synthesized",
        "calibration": calib or "synthetic",
        "rounds": rounds,
        "runs_per_round": runs,
        "machine": {"cpu": cpu.model, "cores": cpu.logical_cores, "features": cpu.features},
        "versions": _versions(),
        "baseline": baseline,
        "kiln_build": built,
        **p99_backing(rounds * runs),
        "p99_note": f"MLPerf needs ≥ {MIN_RUNS_FOR_P99} runs to back a P99 at 99 % confidence",
        "intervals": f"bootstrap 95 %: {BOOTSTRAP_RESAMPLES} resamples of the runs within each "
        "round (seed 0), P50 and P99 computed as the figures they qualify",
        "jitter_floor": measured_floor.to_json(),
        "flops_per_run": flops,
        "roofline": roof_note,
        "engines": {
            name: {
                **_timing_row(name, samples[name], batch, compared[name], measured_floor),
                **_quality(flops, peaks, precisions[name], samples[name], batch),
                "cosine_vs_fp32": drift[name],
                **resident.get(name, {}),
            }
            for name in runners
        },
        "steadiness": steadiness(samples),
        "memory": MEMORY_NOTE if memory else "not measured (--no-memory)",
    }


def _feeds(
    original: ir.Model, dims: dict, shapes: dict | None, inputs: str | None, calib: str | None,
    engines: list[str], batch: int, say: Callable[[str], None],
) -> tuple[dict, list | None, int]:  # fmt: skip
    """The timed runs' feeds (the user's, or synthesized as kiln optimize fits them), the
    int8 engines' calibration samples and the batch a run is."""
    from kiln.compiler.reference import fit_original
    from kiln.ir.inputs import read_calibration, read_inputs
    from kiln.ir.ladder import Guess

    fit = Guess(dict(shapes or {})) if inputs else fit_original(original, shapes, say, dims)
    if inputs:
        feeds = read_inputs(inputs, original)
        batch = _batch_of(original, feeds, batch)  # the inputs say how many samples a run is
    else:
        feeds = synthesize(original, dims, shapes=fit.shapes, scalars=fit.scalars)
    calibration = read_calibration(calib, original) if calib else None
    if calibration is None and any(name.endswith("-int8") for name in engines):
        calibration = [
            synthesize(original, dims, seed=100 + i, shapes=fit.shapes, scalars=fit.scalars)
            for i in range(CALIBRATION_SAMPLES)
        ]  # the engines' own int8 tools calibrated on what the timed runs see
    return feeds, calibration, batch


def _timed_with_floor(
    runners: dict[str, Callable[[], object]], rounds: int, runs: int, say: Callable[[str], None]
) -> tuple[dict[str, list[list[float]]], JitterFloor]:
    """The engines timed interleaved, and the host's jitter floor measured between their
    rounds: the probes see the same moments of the machine as the engines, and run at least
    `FLOOR_RUNS` times each whatever the rounds."""
    scale = _run_scale(runners)
    say(f"sizing the jitter floor's probes to the fastest engine's run ({scale * 1e3:.1f} ms)")
    floor = FloorSampler(target_s=scale)
    per_round = -(-FLOOR_RUNS // rounds)

    def after_round(done: int) -> None:
        floor.window(per_round)
        say(f"round {done}/{rounds}")

    say("timing, interleaved")
    samples = interleave(runners, rounds=rounds, runs=runs, on_round=after_round)
    how = (f"in this run ({per_round} runs of each probe after each round of the engines, "
           f"each probe run sized to {scale * 1e3:.1f} ms, the fastest engine's run)")  # fmt: skip
    return samples, floor.result(measured=how)


def _run_scale(runners: dict[str, Callable[[], object]]) -> float:
    """The fastest engine's run in seconds (the best of three, warm), within the probes'
    reach: the floor's probes take as long, so a stall weighs on them as on the engines."""
    fastest = min(min(time_runs(run, 3)) for run in runners.values())
    return min(max(fastest, FLOOR_SCALE_S[0]), FLOOR_SCALE_S[1])


def _timing_row(
    name: str, rounds: list[list[float]], batch: int, compared: Speedup, floor: JitterFloor
) -> dict:
    """An engine's latency figures, its speedup, and its jitter beside the host's floor."""
    latency = round_stats(rounds, batch)
    tails = tail_interval(rounds)
    parallel = floor.probes.get(PARALLEL_PROBE)
    parallel_jitter = parallel.jitter if parallel is not None else 0.0
    return {
        "description": ENGINES.get(name, "Kiln artifact (compiled, verified)"),
        **latency.to_json(),
        "p99_interval_ms": list(tails.p99_ms),
        "jitter_interval": list(tails.jitter),
        "jitter_over_floor": latency.jitter / floor.floor if floor.floor > 0 else None,
        "jitter_over_floor_interval": _over_floor_interval(rounds, floor),
        # beside fixed work on every core, as an engine with every core runs
        "jitter_over_parallel_floor": (
            latency.jitter / parallel_jitter if parallel_jitter > 0 else None
        ),
        "speedup_vs_baseline": compared.value,
        "speedup_spread": compared.to_json()["speedup_spread"],
        "verdict": compared.verdict,
        # each round's P50, in the order run: any two engines' ratio round by round (the
        # rounds are interleaved, so round i of each shared the machine's state)
        "round_p50_ms": [statistics.median(r) * 1e3 for r in rounds],
    }


def _over_floor_interval(rounds: list[list[float]], floor: JitterFloor) -> list[float] | None:
    """The 95 % bootstrap interval of jitter ÷ floor: whether a reading near a line decides
    it (the floor probe's runs are as noisy as the engine's)."""
    probe = floor.windows.get(floor.probe)
    if floor.floor <= 0 or not probe:
        return None
    # Resamples where the floor's tail vanished divide by zero: no upper bound then.
    return _bounded(*jitter_ratio_interval(rounds, probe))


def _bounded(low: float, high: float) -> list[float] | None:
    """An interval for JSON, which has no infinity: None where it has no upper bound."""
    return [low, high] if math.isfinite(high) else None


def steadiness(samples: dict[str, list[list[float]]]) -> dict[str, dict]:
    """Each engine's jitter against the steadiest other engine's in the same interleaved run:
    the ratio, its 95 % bootstrap interval (both engines' runs redrawn within their rounds)
    and a verdict — "steadiest" (the lowest jitter), "tied" (above the lowest, but an
    interval that reaches 1: no different within noise) or "less steady"."""
    if len(samples) < 2:
        return {}
    jitters = {name: round_stats(rounds).jitter for name, rounds in samples.items()}
    out = {}
    for name, rounds in samples.items():
        others = {k: v for k, v in jitters.items() if k != name}
        rival = min(others, key=others.__getitem__)
        low, high = jitter_ratio_interval(rounds, samples[rival])
        ratio = jitters[name] / others[rival] if others[rival] > 0 else math.inf
        verdict = "steadiest" if ratio <= 1 else "tied" if low <= 1 else "less steady"
        out[name] = {
            "vs": rival,
            "jitter_ratio": ratio if math.isfinite(ratio) else None,
            "interval": _bounded(low, high),
            "verdict": verdict,
        }
    return out


def _roofs(
    original: ir.Model, feeds: dict[str, np.ndarray], say: Callable[[str], None]
) -> tuple[int | None, Peaks | None, str]:
    """FLOPs of one timed run (2 × the original's multiply-accumulates at the fed shapes: the
    useful work, the same for every engine), this machine's peaks (kiln doctor's, from the
    cache; measured once when there are none), and a note on what the fractions mean."""
    from kiln.cost import count_flops
    from kiln.hardware import measured_peaks

    try:
        flops = count_flops(ir.to_proto(original), feed_dims(original, feeds))
        peaks = measured_peaks(progress=lambda step: say(f"measuring this machine: {step}"))
    except KilnError as exc:
        return None, None, f"no roofline fraction or CQI: {exc}"
    if not flops:
        return None, peaks, "no roofline fraction or CQI: the model has no matrix products"
    note = (
        "roofline_fraction = achieved GFLOP/s (flops_per_run ÷ P50) ÷ the measured peak of the "
        f"engine's precision (kiln doctor's peaks, measured {peaks.measured_at}); "
        "cqi = roofline_fraction × (1 − jitter), each clamped to [0, 1]"
    )
    return flops, peaks, note


def _quality(
    flops: int | None, peaks: Peaks | None, precision: str, rounds: list[list[float]], batch: int
) -> dict:
    """Achieved GFLOP/s against the peak of `precision`, and the CQI."""
    from kiln.cost import peak_compute
    from kiln.cost.roofline import PRECISIONS

    if flops is None or peaks is None:
        return {"roofline_fraction": None, "cqi": None}
    latency = round_stats(rounds, batch)
    peak, used = peak_compute(peaks, precision if precision in PRECISIONS else "fp32")
    achieved = flops / (latency.p50_ms * 1e6) if latency.p50_ms > 0 else 0.0
    return {
        "achieved_gflops": achieved,
        "peak_gflops": peak,
        "peak_precision": used,
        "roofline_fraction": achieved / peak,
        "cqi": cqi(achieved / peak, latency.jitter),
    }


MEMORY_NOTE = (
    "peak_rss_mib per engine, each in a process of its own, above that process's RSS before "
    "the build (the interpreter, the engine's library and tools imported, the inputs read): "
    "load = the peak while building, run = the peak over 10 runs after it; weights_mib = the "
    "initializer bytes of the model the engine opens, as stored; tool_peak_mib = the peak of the "
    "engine's own tool (quantizer, optimizer) rewriting the model, in a process before"
)


def _memory(
    engines: list[str],
    original: ir.Model,
    feeds: dict[str, np.ndarray],
    calibration: list | None,
    kiln_artifact: Callable[[Path], str],
    say: Callable[[str], None],
) -> dict[str, dict]:
    """Each engine's memory (kiln.bench.memory): the original as a file the peers open, the
    Kiln row's artifact as kiln.Session opens it."""
    import tempfile

    from kiln.bench.memory import engine_memory

    with tempfile.TemporaryDirectory(prefix="kiln-bench-") as where:
        say("memory: writing the original for the engines' own processes")
        path = Path(where) / "original.onnx"
        ir.save(original, path, external_data="original.onnx.data")
        artifact = kiln_artifact(Path(where))
        measured = engine_memory(
            engines, path, feeds, artifact=artifact, calibration=calibration,
            on_engine=lambda name: say(f"memory of {name}, in a process of its own"),
        )  # fmt: skip
    keys = ("peak_rss_mib", "steady_rss_mib", "weights_mib", "baseline_mib", "tool_peak_mib")
    return {name: {k: m[k] for k in keys if k in m} for name, m in measured.items()}


def _leading_dims(model: ir.Model) -> list[str]:
    """Names of the symbolic first dims of the model's inputs: its batch dims."""
    names = []
    for value in model.graph.inputs:
        shape = value.shape
        if shape is not None and len(shape) and not isinstance(shape[0], int):
            names.append(str(shape[0].value))
    return names


def _batch_of(model: ir.Model, feeds: dict[str, np.ndarray], default: int) -> int:
    """The samples per run of `feeds`: the first axis of an input whose first dim is symbolic."""
    batched = {
        str(v.name) for v in model.graph.inputs if not v.shape or not isinstance(v.shape[0], int)
    }
    sizes = [np.shape(feeds[n])[0] for n in feeds if n in batched and np.ndim(feeds[n]) > 0]
    return int(sizes[0]) if sizes else default


def _drift(runners: dict, reference: list[np.ndarray]) -> dict[str, float]:
    """Each engine's worst per-sample cosine to the fp32 original's floating outputs."""
    from kiln.verify import cosine

    drift = {}
    for name, run_once in runners.items():
        outputs = run_once()
        drift[name] = min(
            (
                cosine(r, o)
                for r, o in zip(reference, outputs, strict=True)
                if np.issubdtype(r.dtype, np.floating) and r.shape == o.shape
            ),
            default=1.0,
        )
    return drift


def _versions() -> dict[str, str]:
    import onnx
    import onnxscript

    from kiln.backends import BACKENDS

    described = [cls().describe() for cls in BACKENDS.values() if cls().available()]
    engines = {d["engine"]: d["version"] for d in described}
    return {
        "kiln": __version__,
        "python": platform.python_version(),
        "onnx": onnx.__version__,
        **engines,
        "onnxscript": onnxscript.__version__,
    }
