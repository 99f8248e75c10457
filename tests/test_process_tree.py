"""kiln.runtime.process_tree: a child's whole tree watched and killed past a memory cap or a
deadline, no descendant left behind."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from kiln.runtime.footprint import vmhwm_mib
from kiln.runtime.process_tree import kill_tree, tree_mib, watch

# A child that starts a grandchild, says so, and waits.
TREE = (
    "import subprocess, sys, time\n"
    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
    "print('started', flush=True)\n"
    "time.sleep(120)\n"
)


def _tree() -> tuple[subprocess.Popen, list[psutil.Process]]:
    proc = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "started"
    return proc, psutil.Process(proc.pid).children(recursive=True)


def _gone(processes: list[psutil.Process]) -> bool:
    _, alive = psutil.wait_procs(processes, timeout=10)
    return not alive


def test_a_tree_over_its_cap_is_killed_with_every_descendant():
    proc, descendants = _tree()
    watched = watch(proc, cap_mib=1.0, deadline=None)
    assert watched.killed == "memory" and watched.at_mib > 1.0
    assert watched.peak_mib >= watched.at_mib
    assert proc.returncode is not None and descendants and _gone(descendants)


def test_a_tree_past_its_deadline_is_killed():
    proc, descendants = _tree()
    watched = watch(proc, cap_mib=None, deadline=time.monotonic())
    assert watched.killed == "time" and _gone(descendants)


def test_a_tree_that_ends_on_its_own_is_not_killed():
    proc = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    watched = watch(proc, cap_mib=None, deadline=None)
    assert watched.killed is None and proc.returncode == 0


def test_the_tree_counts_the_roots_high_water_mark_and_its_descendants():
    proc, descendants = _tree()
    try:
        root = psutil.Process(proc.pid)
        peak = vmhwm_mib(proc.pid)
        assert peak is not None and tree_mib(root) > peak  # the grandchild adds its own pages
    finally:
        kill_tree(proc)
    assert _gone(descendants)
