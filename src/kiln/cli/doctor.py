"""`kiln doctor`: what Kiln found on this machine: versions, CPU, engines, measured peaks, the
bandwidth of each level of the memory hierarchy (L2, L3, DRAM) and the jitter floor."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from rich.table import Table

from kiln.cli.console import JsonOpt, console, emit_json, progress


def doctor(
    as_json: JsonOpt = False,
    refresh: Annotated[
        bool, typer.Option("--refresh", help="Measure the peaks again instead of the cache.")
    ] = False,
) -> None:
    """Python, Kiln and engine versions; CPU model, ISA features, cores, measured peaks (cached)
    and the jitter floor (fixed-work probes, measured now)."""
    import platform

    from kiln import __version__
    from kiln.backends import BACKENDS
    from kiln.hardware import cpu_info, jitter_floor, measured_peaks
    from kiln.report.terminal import print_doctor

    cpu = cpu_info()
    engines = {}
    for name, cls in BACKENDS.items():
        backend = cls()
        engines[name] = backend.describe() if backend.available() else {"available": "no"}
    # Measured once per machine (a few seconds), then read from the cache.
    with progress() as bar:
        task = bar.add_task("peaks", total=None)

        def step(name: str) -> None:
            bar.update(task, description=f"measuring peaks: {name}")

        peaks = measured_peaks(refresh, progress=step)
        # Measured on every run, after the peaks (whose threads would disturb it): the floor
        # is about this moment's load, which a cache would misreport.
        bar.update(task, description="measuring the jitter floor (fixed-work probes)")
        floor = jitter_floor()
    info = {
        "python": platform.python_version(),
        "kiln": __version__,
        "platform": platform.platform(),
        "cpu": cpu.to_json(),
        "hardware_fingerprint": cpu.fingerprint,
        "engines": engines,
        "peaks": peaks.to_json(),
        "jitter_floor": floor.to_json(),
    }
    if as_json:
        emit_json(info)
    else:
        print_doctor(info, console)
        console.print(memory_ceilings(peaks))


def memory_ceilings(peaks: Any) -> Table:
    """The bandwidth of each level of the memory hierarchy the roofline uses: a kernel whose
    working set fits in a level is held to that level's bandwidth."""
    table = Table("level", "holds", "bandwidth", title="memory ceilings (roofline)")
    for level, size, speed in peaks.memory_levels():
        holds = "everything else" if size is None else f"{size / 2**20:g} MiB"
        table.add_row(level, holds, f"{speed:,.1f} GB/s")
    return table
