"""How much memory a `kiln.Session` takes: measured in a fresh Python process of its own, so
that nothing else in the caller's heap (the tuner's other builds, a benchmark's engines, a
test suite) counts — the one memory figure `kiln tune` and `kiln bench` report.

    peak_memory("model.kiln", "feeds.npz", runs=10)
    → {"load_mib": 41.2, "peak_mib": 47.9, "steady_mib": 45.0, "baseline_mib": 182.3, ...}

Run as `python -m kiln.runtime.footprint session|baseline PATH [--feeds F.npz] [--runs N]
[--dims d=N,...] [--backend NAME] [--engine NAME]`, it prints one JSON line: what the parent
reads.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
from collections.abc import Mapping
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
    session is opened and run `runs` times in a child process; a second child does the same
    minus the session (the interpreter, numpy, Kiln's runtime, the engine's library imported,
    the feeds loaded) and is the baseline subtracted from each figure:

    - `load_mib`: peak RSS once the session is open;
    - `peak_mib`: peak RSS over opening and every run (the high-water mark a machine must
      have free);
    - `steady_mib`: RSS after the runs (what the session keeps while it serves).

    Peak RSS is the kernel's high-water mark of the child's own address space (VmHWM in
    /proc/self/status; `resource.getrusage(...).ru_maxrss` where there is no /proc, though
    on Linux that one counts the spawning parent's peak too); the current RSS is psutil's.
    `baseline_mib` (the baseline child's peak) and `runs` are returned too. Raises KilnError
    when the session cannot open or run."""
    if runs < 1:
        raise KilnError(f"peak_memory: runs {runs}: give 1 or more.")
    with tempfile.TemporaryDirectory(prefix="kiln-footprint-") as where:
        feeds_path = _feeds_file(feeds, Path(where))
        common = [*(["--feeds", str(feeds_path)] if feeds_path else []),
                  *(["--dims", _dims_text(dims)] if dims else [])]  # fmt: skip
        session = _child(["session", str(model), "--runs", str(runs), *common,
                          *(["--backend", backend] if backend else [])], timeout_s)  # fmt: skip
        base = _child(["baseline", str(model), "--engine", session["engine"], *common], timeout_s)
    return {
        "load_mib": max(0.0, session["load_peak_mib"] - base["peak_mib"]),
        "peak_mib": max(0.0, session["peak_mib"] - base["peak_mib"]),
        "steady_mib": max(0.0, session["rss_mib"] - base["rss_mib"]),
        "baseline_mib": base["peak_mib"],
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


def _child(args: list[str], timeout_s: float) -> dict[str, Any]:
    return run_child("kiln.runtime.footprint", args, f"measuring the memory of {args[1]}",
                     timeout_s)  # fmt: skip


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


def _measure(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m kiln.runtime.footprint")
    parser.add_argument("mode", choices=("session", "baseline"))
    parser.add_argument("model")
    parser.add_argument("--feeds")
    parser.add_argument("--dims", default="")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--backend")
    parser.add_argument("--engine", default="ort")
    args = parser.parse_args(argv)
    # The same imports either way: only the session differs between the two children.
    from kiln.backends import get_backend
    from kiln.ir.inputs import synthesize
    from kiln.runtime import Session

    feeds = dict(np.load(args.feeds)) if args.feeds else None
    dims = {k: int(v) for k, v in (p.split("=") for p in args.dims.split(",") if p)}
    if args.mode == "baseline":
        get_backend(args.engine).describe()  # the engine's library loaded, as a session does
        return {"peak_mib": peak_rss_mib(), "rss_mib": rss_mib()}
    # No warm-up at open: `load` is the session before any run, and the warm-up is a run
    # (its peak is the runs' below all the same).
    session = Session(args.model, backend=args.backend, steady=False)
    load_peak = peak_rss_mib()
    feeds = feeds if feeds is not None else synthesize(session.interface, dims=dims)
    for _ in range(args.runs):
        session.run(None, feeds)
    engine = session.artifact.manifest.backend.name if session.artifact else args.backend
    return {"engine": engine or "ort", "load_peak_mib": load_peak, "peak_mib": peak_rss_mib(),
            "rss_mib": rss_mib()}  # fmt: skip


def main(argv: list[str]) -> int:
    return child_main(_measure, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
