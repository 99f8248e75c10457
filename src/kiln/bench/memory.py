"""Each engine's resident memory, measured in a process of its own, so that one engine's arena,
weights or import never counts against another's (and the timing process's heap against none).

    engine_memory(["ort", "openvino"], "original.onnx", feeds, artifact="model.kiln")
    → {"ort": {"peak_rss_mib": {"load": 612.0, "run": 455.3}, "baseline_mib": 121.0, ...}, ...}

A child per engine (`python -m kiln.bench.memory ENGINE MODEL FEEDS.npz`) first imports what
that engine needs (the engine's library, its quantization tool) and reads the inputs, then
opens the engine as a user serving it would — the peers on the original model's file; the
`kiln` row as a `kiln.Session` of the artifact — and runs it `runs` times, measured as
`kiln.runtime.footprint.measure_phases` defines for every memory figure: `peak_rss_mib.load`
the high-water mark of opening, `peak_rss_mib.run` that of the runs (the memory a server
holding this engine needs), `steady_rss_mib` what it keeps, each above `baseline_mib`, the
child before the engine opened. An engine whose own tool rewrites the model first (int8
quantizers, the transformer optimizer) has that run in a child before, which saves the model
it wrote for the engine's child to open: its peak, measured alike, is `tool_peak_mib`, a
one-off cost apart from serving. `weights_mib` is the bytes of the model's initializers as
stored in its file (the quantized model's, for the int8 engines).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from kiln.runtime.child import child_main, run_child
from kiln.runtime.footprint import measure_phases

TIMEOUT_S = 900.0
RUNS = 10
# Built from the file the user has, as its engine opens it (the others rewrite the model first).
_FROM_FILE = ("ort", "ort-basic", "openvino", "openvino-bf16")


def engine_memory(
    engines: list[str],
    model: str | Path,
    feeds: Mapping[str, np.ndarray],
    *,
    artifact: str | Path | None = None,
    calibration: list[dict[str, np.ndarray]] | None = None,
    runs: int = RUNS,
    on_engine: Callable[[str], None] | None = None,
) -> dict[str, dict[str, Any]]:
    """Per engine (the `kiln bench` names, and `kiln` when `artifact` is given), its memory in
    MiB, each measured in a child process of its own. `model` is the original .onnx file."""
    out: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kiln-bench-memory-") as where:
        feeds_path = Path(where) / "feeds.npz"
        np.savez(feeds_path, **{k: np.asarray(v) for k, v in feeds.items()})
        calib_path = None
        if calibration:
            calib_path = Path(where) / "calibration.npz"
            np.savez(calib_path, **{f"{i}/{k}": v for i, s in enumerate(calibration)
                                    for k, v in s.items()})  # fmt: skip
        names = [*engines, *(["kiln"] if artifact is not None else [])]
        for name in names:
            if on_engine:
                on_engine(name)
            source, tool = str(artifact if name == "kiln" else model), {}
            if name not in _FROM_FILE and name != "kiln":  # the engine's tool, on its own
                prepared = str(Path(where) / f"{name}.onnx")
                tool = _child([name, source, str(feeds_path), "--prepare-to", prepared,
                               *(["--calib", str(calib_path)] if calib_path else [])])  # fmt: skip
                source = prepared
            out[name] = _child([name, source, str(feeds_path), "--runs", str(runs)]) | tool
    return out


def _child(args: list[str]) -> dict[str, Any]:
    what = f"measuring the memory of engine {args[0]}"
    return run_child("kiln.bench.memory", args, what, TIMEOUT_S)


# ------------------------------------------------------------------------- the child process


def _imports(engine: str) -> None:
    """What building `engine` imports, loaded before the baseline is read: a library's own
    size is the same for every model and is not the engine's memory for this one."""
    from kiln.backends import get_backend, import_tools

    get_backend("ort").describe()
    if "openvino" in engine or engine == "kiln":
        backend = get_backend("openvino")
        if backend.available():
            backend.describe()
    tools = {"ort-int8": "ort-quantization", "openvino-int8": "nncf"}
    import_tools(tools.get(engine, engine))


def _prepare(engine: str, source: str, calib: list | None, out: str) -> None:
    """Run the engine's own tool on the original (its int8 quantizer, its transformer
    optimizer) and save what it wrote to `out`, as a user does before serving it."""
    import onnx_ir as ir

    from kiln.bench.engines import engine_model

    model = ir.load(source)
    ir.external_data.load_to_model(model)  # the tool reads the weights itself, from the cwd
    rewritten = engine_model(engine, model, calib)
    ir.save(rewritten, out, external_data=f"{Path(out).name}.data")


def _open(engine: str, source: str, feeds: dict) -> tuple[Callable[[], object], float]:
    """The engine's run-once function on `source` (an artifact for `kiln`, else the .onnx
    file it runs), and the MiB of that model's weights as stored."""
    from kiln.bench.engines import engine_compile

    if engine == "kiln":
        from kiln.runtime import Session

        # No warm-up at open: `load` is the session before any run, as for the other engines.
        session = Session(source, steady=False)
        return lambda: session.run(None, feeds), _weights_mib(session.artifact.model_path)
    exe = engine_compile(engine, source)
    return lambda: exe.run(feeds), _weights_mib(source)


def _weights_mib(path: str | Path) -> float:
    import onnx_ir as ir

    return _weights_of(ir.load(str(path)))


def _weights_of(model: Any) -> float:
    """Initializer bytes; an external one is counted from its header, never read."""
    total = 0
    for value in model.graph.initializers.values():
        tensor = value.const_value
        if tensor is not None:
            total += tensor.nbytes
    return total / 2**20


def _calibration(path: str | None) -> list[dict[str, np.ndarray]] | None:
    if path is None:
        return None
    samples: dict[int, dict[str, np.ndarray]] = {}
    with np.load(path) as data:
        for key in data.files:
            index, name = key.split("/", 1)
            samples.setdefault(int(index), {})[name] = data[key]
    return [samples[i] for i in sorted(samples)]


def _measure(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m kiln.bench.memory")
    parser.add_argument("engine")
    parser.add_argument("model", help="the .onnx file the engine opens (an artifact for 'kiln')")
    parser.add_argument("feeds", help=".npz of the inputs")
    parser.add_argument("--calib", help=".npz of calibration samples, keys INDEX/INPUT")
    parser.add_argument("--runs", type=int, default=RUNS)
    parser.add_argument("--prepare-to", help="run the engine's tool and save its model here")
    args = parser.parse_args(argv)
    _imports(args.engine)
    with np.load(args.feeds) as data:
        feeds = {k: data[k] for k in data.files}
    if args.prepare_to:
        calibration = _calibration(args.calib)
        tool = measure_phases(
            {"tool": lambda: _prepare(args.engine, args.model, calibration, args.prepare_to)}
        )
        return {"tool_peak_mib": tool["peak_rss_mib"]["tool"]}
    opened: list[tuple[Callable[[], object], float]] = []

    def run() -> None:
        for _ in range(args.runs):
            opened[0][0]()

    measured = measure_phases(
        {"load": lambda: opened.append(_open(args.engine, args.model, feeds)), "run": run}
    )
    return measured | {"weights_mib": opened[0][1], "runs": args.runs}


def main(argv: list[str]) -> int:
    return child_main(_measure, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
