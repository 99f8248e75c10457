"""`kiln doctor`: what Kiln found on this machine: versions, CPU, engines, measured peaks."""

from __future__ import annotations

from typing import Annotated

import typer

from kiln.cli.console import JsonOpt, console, emit_json, progress


def doctor(
    as_json: JsonOpt = False,
    refresh: Annotated[
        bool, typer.Option("--refresh", help="Measure the peaks again instead of the cache.")
    ] = False,
) -> None:
    """Python, Kiln and engine versions; CPU model, ISA features, cores and measured peaks."""
    import platform

    from kiln import __version__
    from kiln.backends import BACKENDS
    from kiln.hardware import cpu_info, measured_peaks
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
        emit_json(info)
    else:
        print_doctor(info, console)
