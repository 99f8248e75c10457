"""The `machine` record every benchmark's JSON carries: this CPU as `kiln doctor` reads it."""

from __future__ import annotations

import platform
from typing import Any

from kiln.hardware import cpu_info


def machine() -> dict[str, Any]:
    cpu = cpu_info()
    return {
        "cpu": cpu.model,
        "cores": cpu.logical_cores,
        "features": cpu.features,
        "platform": platform.platform(),
    }
