"""Background rebuild and hot swap. One daemon thread does every build, one after another: the
request path never compiles for a swap, and builds never pile up. A rebuild compiles, warms
and verifies a whole new bucket set, then installs it with one reference assignment, so that
requests in flight finish on the old set. With adaptive on, the same thread judges the
traffic every `policy.interval_s` and rebuilds when a trigger fires (see adaptive.py)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kiln.errors import KilnError
from kiln.runtime import buckets as bk
from kiln.runtime.adaptive import AdaptivePolicy, Trigger, TriggerKind, find_trigger
from kiln.runtime.bucketset import BucketSet
from kiln.runtime.monitor import LoadMonitor
from kiln.runtime.padding import Verdict

_Job = tuple[bk.Buckets, Trigger, threading.Event]


@dataclass(frozen=True)
class Hooks:
    """What a rebuild needs from its session."""

    current: Callable[[], BucketSet]  # the set requests run on now
    install: Callable[[BucketSet], None]  # the swap itself: one reference assignment
    build: Callable[[BucketSet], None]  # compile, warm, verify; KilnError if a bucket differs
    verdict: Callable[[str], Verdict]  # whether padding a dim is safe
    dynamic_dims: list[str]  # the model's symbolic dims: what an adaptive proposal may bucket
    learnt: Callable[[], None]  # keep the new set for the next session of the model


class Rebuilder:
    def __init__(
        self,
        where: str,
        hooks: Hooks,
        monitor: LoadMonitor,
        policy: AdaptivePolicy,
        adaptive: bool,
    ) -> None:
        self.where = where
        self.hooks = hooks
        self.monitor = monitor
        self.policy = policy
        self.adaptive = adaptive
        self._swap_lock = threading.Lock()  # one build-and-swap at a time
        self._worker_lock = threading.Lock()
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._worker: threading.Thread | None = None
        self._closed = False
        self._last_adapt = 0.0  # time.monotonic() of the last adaptive decision
        self._baseline: dict[str, float] = {}  # bucket -> P99 seconds after the last swap

    def submit(self, buckets: bk.Buckets, trigger: Trigger) -> threading.Event:
        """Queue a rebuild of `buckets`; the event is set when it is done (swapped or kept)."""
        done = threading.Event()
        self.start((buckets, trigger, done))
        return done

    def start(self, job: _Job | None = None) -> None:
        """Start the worker if needed and queue `job`; under the lock close() takes, so that
        no job lands behind close()'s stop signal and waits forever."""
        with self._worker_lock:
            if self._closed:
                raise KilnError(f"{self.where}: the session is closed; open a new one.")
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="kiln-rebuild", daemon=True)
                self._worker.start()
            if job is not None:
                self._jobs.put(job)

    def close(self) -> None:
        """Stop the worker; jobs already queued (a build in progress included) finish first."""
        with self._worker_lock:
            self._closed = True
            worker, self._worker = self._worker, None
            self._jobs.put(None)  # behind any queued job
        if worker is not None:
            worker.join()

    def _work(self) -> None:
        last_check = time.monotonic()
        while True:
            try:
                job = self._jobs.get(timeout=self.policy.interval_s)
            except queue.Empty:
                pass  # no job: time for an adaptive check
            else:
                if job is None:  # close()'s stop signal
                    return
                self._run_job(*job)
            if self.adaptive and time.monotonic() - last_check >= self.policy.interval_s:
                last_check = time.monotonic()
                try:
                    self.adapt()
                except Exception as exc:
                    self.monitor.decide("adaptive check", f"failed: {exc}")

    def _run_job(self, buckets: bk.Buckets, trigger: Trigger, done: threading.Event) -> None:
        # The worker must survive anything a build throws (an engine error, no memory).
        try:
            self.rebuild(buckets, trigger)
        except Exception as exc:
            self.monitor.decide(trigger, f"build failed: {exc}")
        finally:
            done.set()

    def rebuild(self, buckets: bk.Buckets, trigger: Trigger) -> bool:
        """Build, warm and verify a new bucket set, then swap it in; False if it was kept out
        (a bucket failed or differed). Runs on the worker."""
        with self._swap_lock:
            self.monitor.recompiles += 1
            new = BucketSet(buckets)
            old = bk.format_buckets(self.hooks.current().buckets)
            try:
                for dim in buckets:
                    self.hooks.verdict(dim)  # padding checked before any bucket is routed to
                self.hooks.build(new)
            except KilnError as exc:
                self.monitor.decide(trigger, f"kept {old}: {exc}")
                return False
            self.hooks.install(new)
            # The traffic and latencies seen on the old set say nothing about the new one.
            self.monitor.reset_window()
            self._baseline = {}
            self.monitor.decide(trigger, f"swapped {old} -> {bk.format_buckets(buckets)}")
            self.hooks.learnt()
            self.monitor.swapped()  # last: whoever waits for the swap sees all of it
            return True

    def adapt(self) -> None:
        """Judge the traffic since the last swap; rebuild when a trigger fires and a better
        bucket set exists (or, on P99 drift, rebuild the same set afresh)."""
        policy, window = self.policy, self.monitor.window()
        if len(window) < policy.min_samples:
            return
        if self._last_adapt and time.monotonic() - self._last_adapt < policy.cooldown_s:
            return
        try:
            trigger = find_trigger(window, policy, self._baseline)
            if trigger is not None:
                self._last_adapt = time.monotonic()
                self._respond(trigger, [o.dims for o in window])
        finally:
            self.monitor.checked()  # after the outcome is recorded: waiters see all of it

    def _respond(self, trigger: Trigger, observed: list[dict[str, int]]) -> None:
        current = self.hooks.current().buckets
        dims = list(current) or self.hooks.dynamic_dims
        paddable = {d: self.hooks.verdict(d).allowed for d in dims}
        per_dim = max(self.policy.sizes_per_dim, *(len(s) for s in current.values()), 1)
        proposal = bk.propose(observed, dims, paddable, per_dim)
        better = bk.score(observed, proposal, paddable) < bk.score(observed, current, paddable)
        if better:
            self.rebuild(proposal, trigger)
        elif trigger.kind is TriggerKind.P99_DRIFT:
            self.rebuild(current, trigger)  # same set, fresh executables
        else:
            self.monitor.decide(trigger, f"kept {bk.format_buckets(current)}: nothing better")
            self.monitor.reset_window()
