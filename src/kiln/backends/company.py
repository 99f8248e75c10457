"""Who shares this process with a spinning ONNX Runtime pool.

ONNX Runtime's intra-op pool spins for a while after each run, on the cores the next run of
anything else in the process needs (2-core AVX-512 EPYC, run by run: two ORT fp32 artifacts
kept 0.52× / 0.78× of their speed alone; an OpenVINO int8 bert-base beside a spinning ORT fp32
one 0.57–0.63×, and 0.99× with ORT's pool stopped after each run). Alone, a spinning pool has
the steadier tail. So a large model's pool spins while nothing else runs in the process and
stops after each run once company arrives: another such ORT executable, an executable of
another engine that a `kiln.Session` opens (not the peers and candidates Kiln opens only to
measure: those run in blocks, never run by run), or a server (`share_process`).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Protocol


class Quietable(Protocol):
    def stop_spinning(self) -> None: ...


# Reentrant: an ORT executable holds it from "is there company?" through its opening to
# joining, so that two opening at once each see the other.
LOCK = threading.RLock()
_SPINNERS: weakref.WeakSet[Any] = weakref.WeakSet()  # pools that spin until company arrives
_OTHERS: weakref.WeakSet[Any] = weakref.WeakSet()  # company that never spins after a run
_SERVING = threading.Event()  # set by share_process: every pool stops from now on


def crowded() -> bool:
    """Whether an executable opening now has company (call it holding LOCK)."""
    return _SERVING.is_set() or len(_SPINNERS) > 0 or len(_OTHERS) > 0


def join(executable: Any, spins: bool) -> None:
    """`executable` opened in this process: every spinning pool already open stops after each
    run from now on; a `spins` executable (a Quietable) is stopped in turn when the next
    arrives. Both sets hold executables weakly: company that is gone is no company."""
    with LOCK:
        for other in list(_SPINNERS):
            if other is not executable:
                other.stop_spinning()
        (_SPINNERS if spins else _OTHERS).add(executable)


def share_process() -> None:
    """The process runs more than one model's runs (a server's event loop and batchers): from
    now on every large model's pool stops after each run, those open now included."""
    with LOCK:
        _SERVING.set()
        for executable in list(_SPINNERS):
            executable.stop_spinning()
