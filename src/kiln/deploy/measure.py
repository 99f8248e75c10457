"""What one serving replica of an artifact takes and gives, measured in a Python process of
its own (so the figures are this model's, not the exporter's): the peak resident memory of
loading it, running it once at the shapes it was verified on and serving it, and the
requests per second it serves.

The replica runs as a Triton model or `kiln serve` runs it: one `kiln.Session` (the
artifact's engine and settings) behind Kiln's dynamic batcher, `clients` closed-loop
clients each sending one batch-1 request at a time (`kiln.tune.serving.serve`, what
`kiln tune --clients` measures). The clients are threads of the same process: no server,
no network, no request encoding is in the rate, so it is an upper bound on what a served
replica answers (on small models, several times what one does), named `in_process_rps`.

    measure_replica("bert.kiln", clients=16, max_batch=16, max_delay_ms=0.0, seconds=3.0)
    → Replica(peak_mib=312.4, run_peak_mib=290.1, in_process_rps=812.0, p99_ms=25.3, ...)

Run as `python -m kiln.deploy.measure ARTIFACT --clients N --max-batch B --max-delay-ms D
--seconds S`, it prints one JSON line: what the parent reads.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kiln.runtime.child import child_main, run_child

# Loading, one run and the window itself: past this, the child is stuck.
STARTUP_S = 300.0


@dataclass(frozen=True)
class Replica:
    """What one replica measured, memory in MiB of the whole process (interpreter, numpy,
    Kiln, the engine's library, the model, the batches it ran): the child's baseline plus
    its phases' peaks as `kiln.runtime.footprint.measure_phases` defines them."""

    peak_mib: float  # high-water mark over loading, one run and the served window
    run_peak_mib: float  # ... over loading and one run at the verified shapes
    in_process_rps: float  # requests (one sample each) answered per second, no server between
    p99_ms: float  # the requests' P99 latency, in-process
    requests: int  # requests answered in the window
    batches: int  # engine runs they took: fewer than requests when the batcher merged them
    seconds: float
    clients: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def measure_replica(
    artifact: str | Path,
    *,
    clients: int,
    max_batch: int,
    max_delay_ms: float,
    seconds: float,
) -> Replica:
    """Measure one replica of `artifact` in a child process (see the module docstring).
    Raises KilnError when the artifact cannot load or run there."""
    command = [
        str(artifact), "--clients", str(clients),
        "--max-batch", str(max_batch), "--max-delay-ms", repr(float(max_delay_ms)),
        "--seconds", repr(float(seconds)),
    ]  # fmt: skip
    what = f"measuring a replica of {artifact}"
    answer = run_child("kiln.deploy.measure", command, what, STARTUP_S + seconds)
    base, peaks, served = answer["baseline_mib"], answer["peak_rss_mib"], answer["served"]
    return Replica(
        peak_mib=base + max(peaks.values()),
        run_peak_mib=base + max(peaks["load"], peaks["run"]),
        **served,
    )


# ------------------------------------------------------------------------- the child process


def _measure(argv: list[str]) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m kiln.deploy.measure")
    parser.add_argument("artifact")
    parser.add_argument("--clients", type=int, required=True)
    parser.add_argument("--max-batch", type=int, required=True)
    parser.add_argument("--max-delay-ms", type=float, default=0.0)
    parser.add_argument("--seconds", type=float, required=True)
    args = parser.parse_args(argv)
    from kiln.ir.inputs import synthesize
    from kiln.runtime import Session
    from kiln.runtime.footprint import measure_phases
    from kiln.tune.serving import serve

    opened: list[Session] = []
    feeds: list[dict] = []
    served: dict[str, Any] = {}

    def run() -> None:  # once, at the verified shapes, one sample: what each client sends
        session = opened[0]
        dims = {**session.artifact.manifest.dims, **dict.fromkeys(session.batch_dims, 1)}
        feeds.append(synthesize(session.interface, dims=dims))
        session.run(None, feeds[0])

    def serving() -> None:
        done = serve(opened[0].run_batch, feeds, clients=args.clients,
                     max_batch=args.max_batch, max_delay_ms=args.max_delay_ms,
                     seconds=args.seconds)  # fmt: skip
        served.update(in_process_rps=done.rate, p99_ms=done.p99_ms,
                      requests=len(done.latencies_s), batches=done.batches,
                      seconds=args.seconds, clients=args.clients)  # fmt: skip

    try:
        phases = {"load": lambda: opened.append(Session(args.artifact)), "run": run,
                  "serve": serving}  # fmt: skip
        return measure_phases(phases) | {"served": served}
    finally:
        for session in opened:
            session.close()


def main(argv: list[str]) -> int:
    return child_main(_measure, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
