"""The CPUs this process may run on, grouped by physical core, and ONNX Runtime's thread
pinning string for them. Here rather than in kiln.hardware: backends sit below it."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

_SYS = Path("/sys/devices/system/cpu")

CoreOf = Callable[[int], tuple[str, str]]  # logical CPU → (package, core) it belongs to


def allowed_cpus() -> list[int]:
    """Logical CPUs this process may use (its affinity mask: a container's or taskset's)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def core_of(cpu: int) -> tuple[str, str]:
    """(physical package, core id) from sysfs; the CPU itself where sysfs does not say."""
    topology = _SYS / f"cpu{cpu}" / "topology"
    try:
        package = (topology / "physical_package_id").read_text().strip()
        return package, (topology / "core_id").read_text().strip()
    except OSError:
        return "?", f"cpu{cpu}"


def physical_cores(cpus: list[int], core: CoreOf = core_of) -> list[list[int]]:
    """`cpus` grouped by physical core (hyper-thread siblings together), ordered by each
    group's lowest CPU."""
    groups: dict[tuple[str, str], list[int]] = {}
    for cpu in sorted(cpus):
        groups.setdefault(core(cpu), []).append(cpu)
    return sorted(groups.values(), key=min)


def pool_affinities(
    threads: int, cpus: list[int] | None = None, core: CoreOf = core_of
) -> str | None:
    """session.intra_op_thread_affinities for `threads` intra-op threads: one group per pool
    thread (threads − 1: ONNX Runtime never pins the calling thread, which is taken to run
    on the first core), ';' between threads, ',' between a thread's CPUs, ids 1-based.

    With no more threads than physical cores, pool thread i gets core i (all its logical
    CPUs), as ONNX Runtime pins its default pool; with more, one logical CPU each, every
    core's first sibling before any second one. None when there are more threads than CPUs
    (pinning two threads to one CPU would make each op wait for the slower of them)."""
    cpus = allowed_cpus() if cpus is None else cpus
    if threads <= 1 or threads > len(cpus):
        return None
    groups = physical_cores(cpus, core)
    if threads <= len(groups):
        slots = groups
    else:
        depth = max(len(g) for g in groups)
        slots = [[g[i]] for i in range(depth) for g in groups if i < len(g)]
    return ";".join(",".join(str(c + 1) for c in slot) for slot in slots[1:threads])
