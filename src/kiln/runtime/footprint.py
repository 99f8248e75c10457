"""How much memory a model takes, measured in a fresh Python process of its own, so that nothing
else in the caller's heap (the tuner's other builds, a benchmark's engines, a test suite)
counts. `measure_phases` is the one definition every such child uses (`kiln tune`, `kiln
bench`, `kiln export --kserve`), with the same JSON keys, in MiB:

- `baseline_mib`: the child's RSS once everything but the model is imported and read (the
  interpreter, numpy, Kiln, the engine's library, the inputs), after a garbage collection;
- `peak_rss_mib.load`: the high-water mark of RSS while the model opens, above the baseline;
- `peak_rss_mib.run`: the high-water mark while it runs, above the baseline (the mark is
  restarted when each phase begins, so a phase's peak is its own; the largest of them is
  the high-water mark over them all); other phases (`serve`) alike;
- `steady_rss_mib`: RSS after the last phase (what the model keeps while it serves), above
  the baseline;
- `run_peak_includes_load`: true where the kernel cannot restart the mark (no
  /proc/self/clear_refs): each peak then is the child's own since the baseline.

`peak_memory` measures one `kiln.Session` so:

    peak_memory("model.kiln", "feeds.npz", runs=10)
    → {"load_mib": 41.2, "peak_mib": 47.9, "steady_mib": 45.0, "baseline_mib": 182.3, ...}

Run as `python -m kiln.runtime.footprint PATH [--feeds F.npz] [--runs N] [--dims d=N,...]
[--backend NAME]`, it prints one JSON line: what the parent reads.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import resource
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import KilnError
from kiln.runtime.child import child_main, run_child

Feeds = Mapping[str, np.ndarray]
TIMEOUT_S = 600.0


def peak_memory(
    model: str | os.PathLike,
    feeds: str | os.PathLike | Feeds | None = None,
    runs: int = 10,
    *,
    dims: Mapping[str, int] | None = None,
    backend: str | None = None,
    timeout_s: float = TIMEOUT_S,
) -> dict[str, float]:
    """The resident memory of one `kiln.Session` on `model`, in MiB.

    `model`: an artifact directory (NAME.kiln: its engine and settings), an .onnx file or
    zoo:NAME (as `kiln.Session` opens them; `backend` as there). `feeds`: an .npz of inputs,
    or the arrays themselves; None synthesizes inputs (named dims sized by `dims`). The
    session is opened and run `runs` times in a child process, measured by `measure_phases`
    (see the module docstring): `load_mib` is its load peak, `peak_mib` the high-water mark
    over opening and every run (what a machine must have free), `steady_mib` what it keeps
    after the runs, each above `baseline_mib` (the child before the session opened). Peak
    RSS is the kernel's high-water mark of the child's own address space (VmHWM);
    `runs` is returned too. Raises KilnError when the session cannot open or run."""
    if runs < 1:
        raise KilnError(f"peak_memory: runs {runs}: give 1 or more.")
    with tempfile.TemporaryDirectory(prefix="kiln-footprint-") as where:
        feeds_path = _feeds_file(feeds, Path(where))
        args = [str(model), "--runs", str(runs),
                *(["--feeds", str(feeds_path)] if feeds_path else []),
                *(["--dims", _dims_text(dims)] if dims else []),
                *(["--backend", backend] if backend else [])]  # fmt: skip
        measured = run_child("kiln.runtime.footprint", args,
                             f"measuring the memory of {model}", timeout_s)  # fmt: skip
    peaks = measured["peak_rss_mib"]
    return {
        "load_mib": peaks["load"],
        "peak_mib": max(peaks.values()),
        "steady_mib": measured["steady_rss_mib"],
        "baseline_mib": measured["baseline_mib"],
        "runs": float(runs),
    }


def _feeds_file(feeds: str | os.PathLike | Feeds | None, where: Path) -> Path | None:
    if feeds is None:
        return None
    if isinstance(feeds, Mapping):
        path = where / "feeds.npz"
        np.savez(path, **{k: np.asarray(v) for k, v in feeds.items()})
        return path
    path = Path(feeds)
    if not path.is_file():
        raise KilnError(f"{path}: no such inputs file (.npz).")
    return path


def _dims_text(dims: Mapping[str, int]) -> str:
    return ",".join(f"{k}={int(v)}" for k, v in dims.items())


# ------------------------------------------------------------------------- the child process


def peak_rss_mib() -> float:
    """This process's peak RSS: Linux's VmHWM, the high-water mark of its own address space.
    Not `ru_maxrss`, which Linux carries across exec from the process that spawned this one
    (a tuner holding 160 MiB would make every child's peak at least that)."""
    peak = vmhwm_mib()
    if peak is not None:
        return peak
    scale = 2**20 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB elsewhere
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / scale


def vmhwm_mib(pid: int | str = "self") -> float | None:
    """Linux's VmHWM of process `pid` (this one by default), in MiB: the high-water mark of
    its own resident set. None where there is no /proc or the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return None


def reset_peak() -> bool:
    """Restart this process's resident high-water mark at its current RSS (Linux's
    /proc/self/clear_refs, since 4.0), so one process can measure phases in turn; False where
    the kernel cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


def rss_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def measure_phases(phases: Mapping[str, Callable[[], object]]) -> dict[str, Any]:
    """Run `phases` (name → step, in order: "load", "run", and any other) in this process and
    measure each as the module docstring defines: the baseline read now, each phase's
    high-water mark above it, the RSS after the last. Call it once everything but the model
    is imported and read; a child process calls it once."""
    gc.collect()
    baseline = rss_mib()
    restarted = True
    peaks = {}
    for name, step in phases.items():
        restarted = reset_peak() and restarted
        step()
        peaks[name] = max(0.0, peak_rss_mib() - baseline)
    return {
        "peak_rss_mib": peaks,
        "steady_rss_mib": max(0.0, rss_mib() - baseline),
        "baseline_mib": baseline,
        "run_peak_includes_load": not restarted,
    }


def _measure(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m kiln.runtime.footprint")
    parser.add_argument("model")
    parser.add_argument("--feeds")
    parser.add_argument("--dims", default="")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--backend")
    args = parser.parse_args(argv)
    from kiln.backends import get_backend
    from kiln.ir.inputs import synthesize
    from kiln.runtime import Session

    get_backend(_engine(args.model, args.backend)).describe()  # its library: in the baseline
    given = dict(np.load(args.feeds)) if args.feeds else None
    dims = {k: int(v) for k, v in (p.split("=") for p in args.dims.split(",") if p)}
    opened: list[Session] = []

    def load() -> None:
        # No warm-up at open: `load` is the session before any run, and the warm-up is a run.
        opened.append(Session(args.model, backend=args.backend, steady=False))

    def run() -> None:
        session = opened[0]
        feeds = given if given is not None else synthesize(session.interface, dims=dims)
        for _ in range(args.runs):
            session.run(None, feeds)

    return measure_phases({"load": load, "run": run}) | {"runs": args.runs}


def _engine(model: str, backend: str | None) -> str:
    """The engine a session of `model` runs on: `backend`, else an artifact's, else ORT."""
    if backend:
        return backend
    manifest = Path(model) / "manifest.json"
    if manifest.is_file():
        with contextlib.suppress(ValueError, KeyError, TypeError):
            return str(json.loads(manifest.read_text())["backend"]["name"])
    return "ort"


def main(argv: list[str]) -> int:
    return child_main(_measure, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
