"""Who shares this process with a spinning ONNX Runtime pool.

ONNX Runtime's intra-op pool spins for a while after each run, on the cores the next run of
anything else in the process needs: run by run beside a spinning pool, another artifact loses
much of its speed, and nearly none with the pool stopped after each run (the Threads note in
docs/contributing/engine-notes.md; benchmarks/two_sessions.py measures it). Alone, a spinning
pool has the steadier tail. So a pool Kiln opens spins while nothing
else runs in the process and stops after each run once company arrives: another ORT
executable, an executable of another engine that a `kiln.Session` opens (not the peers and
candidates Kiln opens only to time them, in blocks, never run by run), or a server
(`share_process`). Small models' pools are the exception among themselves: two sub-millisecond
models alternating lose less to each other's spinning than to stopping, so a small pool stops
only beside a large one, another engine or a server.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

log = logging.getLogger("kiln.backends")

# Reentrant: an ORT executable holds it from "is there company?" through its opening to
# joining, so that two opening at once each see the other.
LOCK = threading.RLock()
# Pools that spin until company arrives, each with whether its model is small; and company
# that never spins after a run. Both weak: company that is gone is no company.
_SPINNERS: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
_OTHERS: weakref.WeakSet[Any] = weakref.WeakSet()
_SERVING = threading.Event()  # set by share_process: every pool stops from now on


def crowded(small: bool = False) -> bool:
    """Whether a pool opening now has company (call it holding LOCK); a `small` one keeps
    spinning beside other small ones."""
    if _SERVING.is_set() or len(_OTHERS) > 0:
        return True
    return any(not s for s in _SPINNERS.values()) if small else len(_SPINNERS) > 0


def join(executable: Any, spins: bool, small: bool = False) -> None:
    """`executable` opened in this process: every spinning pool already open stops after each
    run from now on (a small one stays spinning if the newcomer is a small pool too); a
    `spins` executable (one with `stop_spinning()`) is stopped in turn when its company
    arrives. An executable already here joins once."""
    with LOCK:
        if executable in _SPINNERS or executable in _OTHERS:
            return
        for other, other_small in list(_SPINNERS.items()):
            if not (spins and small and other_small):
                _quiet(other)
        if spins:
            _SPINNERS[executable] = small
        else:
            _OTHERS.add(executable)


def join_company(executable: Any) -> None:
    """A `kiln.Session` opened `executable` for the user's program: it is company for every
    spinning pool while it lives (a pool that spins itself joined as it opened)."""
    join(executable, spins=False)


def share_process() -> None:
    """The process runs more than one model's runs (a server's event loop and batchers): from
    now on every pool stops after each run, those open now included."""
    with LOCK:
        _SERVING.set()
        for executable in list(_SPINNERS):
            _quiet(executable)


def leave_company(executable: Any) -> None:
    """`executable` no longer runs (its session closed; its files may be gone before the
    garbage collector takes it): it is no one's company, and never reopened."""
    with LOCK:
        _SPINNERS.pop(executable, None)
        _OTHERS.discard(executable)


def _quiet(executable: Any) -> None:
    """Stop `executable`'s pool after each run. Reopening it can fail where the executable is
    garbage the collector has not taken yet (its model file deleted, or the in-memory model it
    was opened on changed since): then it keeps spinning, and the newcomer opens all the same —
    a stopped pool is a courtesy, never a reason to refuse a model, nor a line on a terminal
    (a debug log only: a verb's error is one line)."""
    try:
        executable.stop_spinning()
    except Exception as exc:  # whatever the engine raised for a model it cannot read again
        log.debug("could not stop a spinning ONNX Runtime pool (%s); it keeps spinning", exc)
        _SPINNERS.pop(executable, None)
