"""`kiln bench`'s peak_rss_mib against an independent measurement.

    python benchmarks/bench_memory_check.py /tmp/sc/bert-base.kiln --against ort,openvino

Kiln's figure: `kiln bench ARTIFACT --against ... --json` (each engine in a child of its own,
its VmHWM over the RSS it had before the build). The independent one: GNU time's maximum
resident set (`/usr/bin/time -f %M`, the kernel's wait4 accounting) of the few lines a user
writes — `onnxruntime.InferenceSession(path)`, OpenVINO's `compile_model(path)`,
`kiln.Session(artifact)`, each run 10 times — minus that of the same script without the
session (the imports and the inputs). A process's peak is Kiln's larger figure (the run peak
starts from what the load left), so each engine's max(load, run) is checked within 15 % of
the independent one. Prints the command, CPU, versions and every figure; writes JSON and the
result file. Takes one `kiln bench --rounds 1 --runs 3` of the artifact and two short processes
per engine: a few minutes for a full-size model.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx_ir as ir
from _results import Recorder, add_arguments, row  # benchmarks/ is the script's own directory

import kiln
from kiln.compiler.api import load_source
from kiln.hardware import cpu_info
from kiln.runtime import Session

WITHIN = 0.15
RUNS = 10

# What a user writes: (imports, opening the session, running it once). FEEDS and MODEL are
# filled in; {feeds} is a dict of arrays.
_USER = {
    "ort": ("import onnxruntime as ort", "s = ort.InferenceSession(MODEL)",
            "s.run(None, feeds)"),
    "openvino": ("import openvino as ov",
                 "s = ov.Core().compile_model(MODEL, 'CPU', {'INFERENCE_PRECISION_HINT': 'f32', "
                 "'PERFORMANCE_HINT': 'LATENCY'}).create_infer_request()",
                 "s.infer(feeds)"),
    # `import kiln` loads no engine or runtime: the baseline imports them, as for the others.
    "kiln": ("import kiln, onnxruntime, openvino\nfrom kiln.runtime import Session",
             "s = Session(ARTIFACT)",
             "s.run(None, feeds)"),
}  # fmt: skip


def script(engine: str, model: Path, artifact: Path, feeds: Path, with_session: bool) -> str:
    imports, open_, run = _USER[engine]
    lines = ["import numpy as np", imports,
             f"feeds = dict(np.load({str(feeds)!r}))",
             f"MODEL, ARTIFACT = {str(model)!r}, {str(artifact)!r}"]  # fmt: skip
    if with_session:
        lines += [open_, f"for _ in range({RUNS}):", f"    {run}"]
    return "\n".join(lines) + "\n"


def max_rss_mib(code: str) -> float:
    done = subprocess.run(["/usr/bin/time", "-f", "%M", sys.executable, "-c", code],
                          capture_output=True, text=True, check=True)  # fmt: skip
    return int(done.stderr.strip().splitlines()[-1]) / 1024  # KiB


def independent(engines: list[str], artifact: Path, feeds: dict, where: Path) -> dict:
    session = Session(str(artifact))
    original = load_source(session.artifact.manifest.source.path).model
    session.close()
    model = where / "original.onnx"
    ir.save(original, model, external_data="original.onnx.data")
    feeds_path = where / "feeds.npz"
    np.savez(feeds_path, **feeds)
    out = {}
    for engine in engines:
        base = max_rss_mib(script(engine, model, artifact, feeds_path, False))
        full = max_rss_mib(script(engine, model, artifact, feeds_path, True))
        out[engine] = {"baseline_mib": base, "peak_mib": full, "net_mib": full - base}
        print(f"independent {engine:9} peak {full:8.1f} MiB − baseline {base:7.1f} = "
              f"{full - base:8.1f} MiB", flush=True)  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--against", default="ort,openvino")
    parser.add_argument("--json", default="results/bench_memory_check.json")
    add_arguments(parser)
    args = parser.parse_args()
    recorder = Recorder("bench_memory_check")
    if not shutil.which("/usr/bin/time"):
        raise SystemExit("needs GNU time at /usr/bin/time (apt-get install time)")
    cpu = cpu_info()
    command = " ".join([Path(sys.executable).name, *sys.argv])
    print(command)
    print(f"{cpu.model}, {cpu.logical_cores} cores, {' '.join(cpu.features)}, "
          f"{platform.platform()}; kiln {kiln.__version__}", flush=True)  # fmt: skip
    bench_cmd = [sys.executable, "-m", "kiln", "bench", str(args.artifact), "--against",
                 args.against, "--rounds", "1", "--runs", "3", "--json"]  # fmt: skip
    print(" ".join(bench_cmd[1:]), flush=True)
    bench = json.loads(subprocess.run(bench_cmd, capture_output=True, text=True,
                                      check=True).stdout)  # fmt: skip
    # The int8 engines' models exist only inside the bench (what their tools wrote): shown,
    # not checked.
    for engine in args.against.split(","):
        peak = bench["engines"][engine]["peak_rss_mib"]
        print(f"{engine:13} kiln bench load {peak['load']:8.1f} run {peak['run']:8.1f} MiB, "
              f"weights {bench['engines'][engine]['weights_mib']:.1f} MiB", flush=True)  # fmt: skip
    engines = [e for e in [*args.against.split(","), "kiln"] if e in _USER]
    with tempfile.TemporaryDirectory(prefix="kiln-memory-check-") as where:
        # The inputs bench timed: synthesized as kiln.Session's interface asks.
        from kiln.ir.inputs import synthesize

        feeds = synthesize(Session(str(args.artifact)).interface)
        measured = independent(engines, args.artifact, feeds, Path(where))
    rows = {}
    for engine in engines:
        kiln_peak = bench["engines"][engine]["peak_rss_mib"]
        ratio = max(kiln_peak.values()) / measured[engine]["net_mib"]
        rows[engine] = {"kiln": kiln_peak, "independent": measured[engine], "ratio": ratio,
                        "within_15pct": abs(ratio - 1) <= WITHIN}  # fmt: skip
        print(f"{engine:9} kiln bench load {kiln_peak['load']:8.1f} run {kiln_peak['run']:8.1f}"
              f" MiB | independent {measured[engine]['net_mib']:8.1f} MiB | ratio {ratio:.3f} "
              f"({'within' if rows[engine]['within_15pct'] else 'NOT within'} 15 %)")  # fmt: skip
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": command, "cpu": cpu.model, "features": cpu.features,
                               "bench": bench, "rows": rows}, indent=2) + "\n")  # fmt: skip
    print(f"wrote {out}")
    recorder.write([
        row(f"{engine}: kiln bench peak ÷ independent peak", figures["ratio"], "x",
            verdict="within 15 %" if figures["within_15pct"] else "not within 15 %",
            engine=engine)
        for engine, figures in rows.items()
    ], {"bench": bench, "rows": rows}, args.results)  # fmt: skip


if __name__ == "__main__":
    main()
