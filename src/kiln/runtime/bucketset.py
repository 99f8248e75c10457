"""One bucket set and its shape-specialised executables: compiled on first use, once, and the
least recently used dropped beyond a cap. A swap replaces a whole set, never part of one."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import onnx_ir as ir

from kiln.backends import Executable
from kiln.ir.weights import weight_bytes
from kiln.runtime import buckets as bk
from kiln.runtime.monitor import LoadMonitor


@dataclass
class BucketSet:
    """One bucket set and its executables, replaced as a whole by a swap."""

    buckets: bk.Buckets
    # Least recently used first: the order in which executables are dropped.
    runners: OrderedDict[bk.BucketKey, Executable] = field(default_factory=OrderedDict)
    broken: set[bk.BucketKey] = field(default_factory=set)  # failed to compile or run
    lock: threading.Lock = field(default_factory=threading.Lock)  # guards `runners`
    compile_lock: threading.Lock = field(default_factory=threading.Lock)  # one compile at once

    def runner(
        self,
        key: bk.BucketKey,
        compile_key: Callable[[bk.BucketKey], Executable],
        cap: int,
        monitor: LoadMonitor,
    ) -> Executable:
        """The bucket's runner; the first request of a bucket compiles it, once. Beyond `cap`
        the least recently used one is dropped (requests running on it finish; it is rebuilt
        if needed again)."""
        with self.lock:
            runner = self.runners.get(key)
            if runner is not None:
                self.runners.move_to_end(key)
                return runner
        # A separate lock: requests for buckets already built go on during a compile.
        with self.compile_lock:
            runner = self.runners.get(key)
            if runner is None:
                runner = compile_key(key)
                monitor.compiles += 1
                with self.lock:
                    self.runners[key] = runner
                    while len(self.runners) > cap:
                        self.runners.popitem(last=False)
                        monitor.evictions += 1
        return runner


def executable_cap(model: ir.Model, shared: bool) -> int:
    """How many bucket executables stay loaded: their estimated memory (a weight copy each,
    taken as twice the weights, about what an OpenVINO executable of bert-base holds:
    benchmarks/openvino_memory.py; an eighth of that when the weights are shared) within a
    quarter of the machine's memory; between 2 and 32."""
    weights = weight_bytes(model)
    each = max(weights // 8 if shared else weights * 2, 16 << 20)
    try:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        memory = 8 << 30
    return max(2, min(32, memory // 4 // each))
