"""Memory near its floor: OpenVINO artifacts' resident memory against their floor.

    python benchmarks/openvino_memory.py /tmp/ovfp32.kiln /tmp/ovint8.kiln \
        [--runs 20] [--rounds 5] [--out results/openvino_memory.json]

ARTIFACTs are Kiln OpenVINO artifacts with external weights (`kiln optimize zoo:bert-base
--backend openvino --precision int8 -o /tmp/ovint8.kiln --rounds 0`). Every figure is MiB
above a baseline read in the same child process: Python, Kiln, OpenVINO imported, its CPU
plugin loaded and the inputs made (`b0`).

- floor = the weights as the engine holds them (the bytes of the compiled model's runtime
  constants: repacked, constant-folded, at their element types) + an empty session's
  footprint (a child compiling a 64-weight MatMul and running it 10 times: its RSS above b0),
  OpenVINO's own (nothing released); `floor_released_mib` is the stricter floor with the
  empty session's library pages given back as Kiln's `release_code` gives back the model's
  (it can fall below b0: the pages the import read go too);
- per variant, each in a child of its own: `load` (peak while compiling), `first` (peak over
  the first run), `steady` (peak over the next `--runs` runs), `run` (the peak over all runs,
  first included, as `kiln bench`'s memory child reads it), RSS at the end split into
  anonymous and file-backed pages, and `run` / floor;
- latency: Kiln's default against the same artifact with `release_mapped` off, both compiled
  in one process and timed interleaved (`--rounds` rounds of `--runs` runs), P50 ratio with
  the per-round spread: this machine is shared, so read the spread, not one ratio.

Variants: `kiln` (Kiln's default now: mmap + release_mapped + release_code),
`kiln-no-code-release` (release_code off), `kiln-no-release` (mmap
only), `kiln-no-mmap` (weights read into memory), `ov-path` (OpenVINO as-is:
`Core().compile_model(path)`, no Kiln in the way). Each row also has the first three runs' times
(`first_runs_ms`): what the first runs pay for what was released. Writes `--out` and the
result file. Each artifact takes about a minute for bert-base (seven children, then the
latency rounds).
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _results import Recorder, add_arguments, row  # benchmarks/ is the script's own directory

VARIANTS = ("kiln", "kiln-no-code-release", "kiln-no-release", "kiln-no-mmap", "ov-path")
_NONE = {"release_mapped": False, "release_code": False}
_SETTINGS = {
    "kiln": {},
    "kiln-no-code-release": {"release_code": False},
    "kiln-no-release": _NONE,
    "kiln-no-mmap": {"mmap": False, **_NONE},
}


# ----------------------------------------------------------------------------- children


def _status(key: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _setup(artifact: str) -> tuple[Any, dict, dict[str, Any], Path]:
    """Imports, the CPU plugin loaded, the inputs: what every child holds before its b0."""
    import onnx_ir as ir

    from kiln.backends import get_backend
    from kiln.ir.inputs import synthesize

    backend = get_backend("openvino")
    backend.describe()
    manifest = json.loads((Path(artifact) / "manifest.json").read_text())
    model_path = Path(artifact) / "model.onnx"
    feeds = synthesize(ir.load(str(model_path)))
    return backend, feeds, manifest["backend"]["options"], model_path


def _weights_held_mib(compiled: Any) -> float:
    """Bytes of the runtime model's constants: the weights as OpenVINO holds them."""
    import numpy as np

    total = 0
    for op in compiled.get_runtime_model().get_ordered_ops():
        info = op.get_rt_info()
        if "layerType" not in info or str(info["layerType"].astype(str)) != "Const":
            continue
        for out in op.outputs():
            shape = out.get_partial_shape()
            if shape.is_static:
                count = int(np.prod([d.get_length() for d in shape]))
                total += count * out.get_element_type().size
    return total / 2**20


def child_variant(variant: str, artifact: str, runs: int) -> dict[str, Any]:
    import openvino as ov

    from kiln.backends import options_from_json
    from kiln.runtime.footprint import reset_peak

    backend, feeds, options, model_path = _setup(artifact)
    b0, anon0, file0 = _status("VmRSS"), _status("RssAnon"), _status("RssFile")
    if variant == "ov-path":
        props = options_from_json("openvino", options).properties()
        compiled = ov.Core().compile_model(str(model_path), "CPU", props)
        request = compiled.create_infer_request()

        def run() -> object:
            return request.infer(feeds)
    else:
        settings = {**options, **_SETTINGS[variant]}
        exe = backend.compile(str(model_path), options_from_json("openvino", settings))
        compiled = exe.compiled

        def run() -> object:
            return exe.run(feeds)

    load = _status("VmHWM") - b0
    reset_peak()
    times = [_timed(run)]
    first = _status("VmHWM") - b0
    reset_peak()
    times += [_timed(run) for _ in range(2)]
    for _ in range(runs - 2):
        run()
    steady = _status("VmHWM") - b0
    return {
        "b0_mib": b0,
        "load_mib": load,
        "first_mib": first,
        "steady_mib": steady,
        "run_mib": max(first, steady),
        "rss_mib": _status("VmRSS") - b0,
        "anon_mib": _status("RssAnon"),
        "file_mib": _status("RssFile"),
        # above b0: library code pages this model's kernels touched, and anonymous memory
        # (the weights as held, the graph, JIT code, activations)
        "code_pages_mib": _status("RssFile") - file0,
        "anon_grown_mib": _status("RssAnon") - anon0,
        "weights_held_mib": _weights_held_mib(compiled),
        "first_runs_ms": times,
    }


def _timed(run: Any) -> float:
    start = time.perf_counter()
    run()
    return (time.perf_counter() - start) * 1e3


def child_empty(artifact: str, released: bool) -> dict[str, Any]:
    """An empty session's footprint: a 64-weight MatMul compiled and run 10 times, by
    OpenVINO as it is (`released` False) or with its library pages given back."""
    import numpy as np
    import onnx_ir as ir

    from kiln.backends import options_from_json

    backend, _, options, _ = _setup(artifact)
    b0, file0 = _status("VmRSS"), _status("RssFile")
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["n", 8]))
    w = ir.Value(name="w", const_value=ir.tensor(np.ones((8, 8), np.float32), name="w"))
    node = ir.node("MatMul", [x, w], num_outputs=1)
    node.outputs[0].name = "y"
    graph = ir.Graph([x], node.outputs, nodes=[node], initializers=[w], opset_imports={"": 17})
    settings = {**options, **({} if released else _NONE)}
    exe = backend.compile(ir.Model(graph, ir_version=8), options_from_json("openvino", settings))
    for _ in range(10):
        exe.run({"x": np.ones((1, 8), np.float32)})
    return {
        "b0_mib": b0,
        "empty_session_mib": _status("VmRSS") - b0,
        "code_pages_mib": _status("RssFile") - file0,
    }


def child_latency(artifact: str, runs: int, rounds: int) -> dict[str, Any]:
    from kiln.backends import options_from_json
    from kiln.timing import interleave, round_stats, speedups

    backend, feeds, options, model_path = _setup(artifact)
    runners = {}
    for variant in ("kiln-no-release", "kiln"):
        settings = {**options, **_SETTINGS[variant]}
        exe = backend.compile(str(model_path), options_from_json("openvino", settings))
        runners[variant] = (lambda e: lambda: e.run(feeds))(exe)
    samples = interleave(runners, rounds=rounds, runs=runs, warmup=3)
    ratio = speedups(samples, "kiln-no-release")["kiln"].to_json()
    per_round = [
        sorted(a)[len(a) // 2] / sorted(b)[len(b) // 2]
        for a, b in zip(samples["kiln"], samples["kiln-no-release"], strict=True)
    ]
    return {
        "p50_ms": {k: round_stats(v).p50_ms for k, v in samples.items()},
        # Kiln's default over release_mapped off: > 1 means slower
        "latency_ratio": 1 / ratio["speedup"],
        "latency_ratio_per_round": per_round,
        "verdict": ratio["verdict"],
    }


def _child_main(argv: list[str]) -> None:
    mode, artifact, runs, rounds = argv[0], argv[1], int(argv[2]), int(argv[3])
    if mode.startswith("empty"):
        answer = child_empty(artifact, released=mode == "empty-released")
    elif mode == "latency":
        answer = child_latency(artifact, runs, rounds)
    else:
        answer = child_variant(mode, artifact, runs)
    print(json.dumps(answer))


# ----------------------------------------------------------------------------- the parent


def _child(mode: str, artifact: Path, runs: int, rounds: int) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", mode, str(artifact), str(runs), str(rounds)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{mode} on {artifact}: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def machine() -> dict[str, Any]:
    import openvino as ov

    import kiln
    from kiln.hardware import cpu_info

    cpu = cpu_info()
    line = (f"{cpu.model}, {cpu.physical_cores} physical / {cpu.logical_cores} logical cores, "
            f"{' '.join(cpu.features)}")  # fmt: skip
    return {
        "cpu": line,
        "platform": platform.platform(),
        "versions": {
            "python": platform.python_version(),
            "kiln": kiln.__version__,
            "openvino": ov.__version__.split("-")[0],
        },  # fmt: skip
    }


def measure(artifact: Path, runs: int, rounds: int) -> dict[str, Any]:
    empty_row = _child("empty", artifact, runs, rounds)
    empty = empty_row["empty_session_mib"]
    empty_released = _child("empty-released", artifact, runs, rounds)["empty_session_mib"]
    variants = {v: _child(v, artifact, runs, rounds) for v in VARIANTS}
    held = variants["kiln"]["weights_held_mib"]
    floor = held + empty
    for figures in variants.values():
        figures["run_over_floor"] = figures["run_mib"] / floor
        figures["steady_over_floor"] = figures["steady_mib"] / floor
        figures["steady_over_floor_released"] = figures["steady_mib"] / (held + empty_released)
    manifest = json.loads((artifact / "manifest.json").read_text())
    data = artifact / "model.onnx.data"
    return {
        "artifact": str(artifact),
        "precision": manifest.get("precision", {}),
        "weights_file_mib": data.stat().st_size / 2**20 if data.exists() else 0.0,
        "weights_held_mib": held,
        "empty_session_mib": empty,
        "empty_code_pages_mib": empty_row["code_pages_mib"],
        "floor_mib": floor,
        "empty_session_released_mib": empty_released,
        "floor_released_mib": held + empty_released,
        "variants": variants,
        "latency": _child("latency", artifact, runs, rounds),
    }


def _print(result: dict[str, Any]) -> None:
    print(f"\n{result['artifact']}: weights file {result['weights_file_mib']:.0f} MiB, held "
          f"{result['weights_held_mib']:.0f} MiB + empty session {result['empty_session_mib']:.0f}"
          f" = floor {result['floor_mib']:.0f} MiB; with the empty session's library pages "
          f"released {result['empty_session_released_mib']:.0f} -> floor "
          f"{result['floor_released_mib']:.0f}")  # fmt: skip
    print(f"{'variant':21} {'load':>6} {'first':>6} {'steady':>6} {'run':>6} {'anon':>6} "
          f"{'file':>6} {'run/floor':>9} {'/released':>9}  first runs ms")  # fmt: skip
    for name, got in result["variants"].items():
        runs = " ".join(f"{t:.0f}" for t in got["first_runs_ms"])
        print(f"{name:21} {got['load_mib']:6.0f} {got['first_mib']:6.0f} {got['steady_mib']:6.0f}"
              f" {got['run_mib']:6.0f} {got['anon_mib']:6.0f} {got['file_mib']:6.0f}"
              f" {got['run_over_floor']:9.2f} {got['steady_over_floor_released']:9.2f}  "
              f"{runs}")  # fmt: skip
    kiln = result["variants"]["kiln"]
    other = kiln["anon_grown_mib"] - kiln["weights_held_mib"]
    print(f"kiln above its weights: library code pages {kiln['code_pages_mib']:.0f} MiB (empty "
          f"session {result['empty_code_pages_mib']:.0f}), other anonymous memory {other:.0f} "
          "(graph, JIT code, activations)")  # fmt: skip
    lat = result["latency"]
    rounds = ", ".join(f"{r:.3f}" for r in lat["latency_ratio_per_round"])
    print(f"latency kiln / kiln-no-release: {lat['latency_ratio']:.3f} ({lat['verdict']}; per "
          f"round {rounds}); P50 {lat['p50_ms']['kiln']:.1f} vs "
          f"{lat['p50_ms']['kiln-no-release']:.1f} ms")  # fmt: skip


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        _child_main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("artifacts", nargs="+", type=Path)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("results/openvino_memory.json"))
    add_arguments(parser)
    args = parser.parse_args()
    recorder = Recorder("openvino_memory")
    command = " ".join([Path(sys.executable).name, *sys.argv])
    info = machine()
    print(command)
    print(info["cpu"])
    print(f"{info['platform']}; " + ", ".join(f"{k} {v}" for k, v in info["versions"].items()))
    results = []
    for artifact in args.artifacts:
        results.append(measure(artifact, args.runs, args.rounds))
        _print(results[-1])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"command": command, **info, "results": results}, indent=2))
    print(f"\nwrote {args.out}")
    recorder.write(memory_rows(results), {"command": command, **info, "results": results},
                   args.results)  # fmt: skip


def memory_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per artifact: its floor, each variant's run peak, and the latency Kiln's release costs."""
    found = []
    for result in results:
        name = Path(result["artifact"]).stem
        found.append(row(f"{name}: floor", result["floor_mib"], "MiB", model=name))
        for variant, figures in result["variants"].items():
            found.append(row(f"{name} {variant}: run peak", figures.get("run_mib"), "MiB",
                             model=name, variant=variant))  # fmt: skip
        latency = result["latency"]
        per_round = latency["latency_ratio_per_round"]
        found.append(row(
            f"{name}: P50 with release_mapped ÷ without (above 1: slower)",
            latency["latency_ratio"], "x", [min(per_round), max(per_round)],
            latency["verdict"], model=name,
        ))  # fmt: skip
    return found


if __name__ == "__main__":
    main()
