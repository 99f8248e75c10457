"""A child's whole process tree, supervised: polled for its memory until it ends, killed (every
descendant with it) past a memory cap or a deadline. The child leads its own session
(`subprocess.Popen(..., start_new_session=True)`), so a kill reaches its process group and
never the parent's.

    proc = subprocess.Popen([...], start_new_session=True)
    try:
        watched = watch(proc, cap_mib=2048, deadline=time.monotonic() + 600)
    except BaseException:  # Ctrl-C, SIGTERM: the child's own session hears no signal
        kill_tree(proc)
        raise
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Any

POLL_S = 0.05  # the period under a memory cap
# ... and without one (the peak is still read: VmHWM misses no spike of the root). Each poll
# walks /proc and reads every descendant's USS: at 20 Hz that took ≈ 20 % of a core from the
# child it measures on a 2-core machine.
POLL_UNCAPPED_S = 0.5
MIB = 2**20


@dataclass(frozen=True)
class Watched:
    """How a watched tree ended: the peak (MiB) the polls saw and, when it was killed, why —
    "memory" (then `at_mib` is the tree's memory over the cap) or "time"."""

    peak_mib: float
    killed: str | None = None
    at_mib: float = 0.0


def watch(proc: subprocess.Popen, cap_mib: float | None, deadline: float | None) -> Watched:
    """Poll `proc`'s tree every POLL_S (POLL_UNCAPPED_S without a cap) until it ends; kill the
    tree past `cap_mib` or `deadline` (time.monotonic())."""
    import psutil

    try:
        root = psutil.Process(proc.pid)
    except psutil.Error:  # it has already ended
        proc.wait()
        return Watched(0.0)
    peak = 0.0
    while proc.poll() is None:
        mib = tree_mib(root)
        peak = max(peak, mib)
        if cap_mib is not None and mib > cap_mib:
            kill_tree(proc)
            return Watched(peak, "memory", mib)
        if deadline is not None and time.monotonic() > deadline:
            kill_tree(proc)
            return Watched(peak, "time", mib)
        time.sleep(POLL_S if cap_mib is not None else POLL_UNCAPPED_S)
    return Watched(peak)


def tree_mib(root: Any) -> float:
    """The memory of `root`'s tree (a psutil.Process): root's resident high-water mark (VmHWM:
    no spike between two polls is missed) plus each descendant's unique set (USS: a forked
    loader worker shares its parent's pages, which its RSS would count again)."""
    import psutil

    total = _root_peak_mib(root)
    with contextlib.suppress(psutil.Error):
        for child in root.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                total += child.memory_full_info().uss / MIB
    return total


def _root_peak_mib(process: Any) -> float:
    """VmHWM of `process`; its current RSS where the kernel has no /proc."""
    import psutil

    from kiln.runtime.footprint import vmhwm_mib

    peak = vmhwm_mib(process.pid)
    if peak is not None:
        return peak
    try:
        return process.memory_info().rss / MIB
    except psutil.Error:
        return 0.0


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL the child's process group (it leads its own session) and any descendant that
    left it; then reap the child."""
    import psutil

    try:
        stragglers = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        stragglers = []
    with contextlib.suppress(OSError):
        if os.getpgid(proc.pid) == proc.pid != os.getpgid(0):
            os.killpg(proc.pid, signal.SIGKILL)
    for process in stragglers:
        with contextlib.suppress(psutil.Error):
            process.kill()
    proc.kill()
    proc.wait()
