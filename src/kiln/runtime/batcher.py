"""Dynamic batching: concurrent requests are queued and run together by one worker thread.

The worker takes the oldest request, waits up to `max_delay` (counted from that request's
arrival) for more to fill `max_batch` samples, and hands them to `run_batch` in one call. With
`preferred` batch sizes (Triton's `preferred_batch_size`), a batch of one of them that the queue
can form goes at once, the largest such; `combine=False` runs each request alone (Triton's
default scheduler, a model without dynamic batching). One worker by default, because the engine
already uses every core for one batch: two batches at once would only fight over them;
`workers` > 1 (Triton's instance count) runs that many batches side by side. The queue is
bounded; a full queue refuses new work at once (`Overloaded`, HTTP 503) instead of growing
memory and latency without limit. `close()` stops taking new work and lets the workers finish
everything already queued.

With `group`, a batch holds only requests of the oldest one's group (a pipeline's stage: the
calls whose shapes merge into one run): a detector's images of other sizes would otherwise ride
along in one `run_batch`, run one after another by one worker while the others idle, and hold
every answer until the last.

`run_now` runs a lone request in the caller's thread when a worker would run it alone at once
anyway (no wait for company, nothing queued, a worker free) and batches are short: it saves
the two thread hand-offs (to the worker and back), each a wake-up that waits for a core.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

Feeds = dict[str, np.ndarray]
RunBatch = Callable[[list[Feeds]], list[list[np.ndarray]]]


class Overloaded(Exception):
    """The queue is full; the client should retry later (HTTP 503)."""


class Closed(Exception):
    """The server is shutting down and takes no new requests (HTTP 503)."""


@dataclass
class Job:
    feeds: Feeds
    samples: int
    future: Future = field(default_factory=Future)
    enqueued: float = field(default_factory=time.perf_counter)
    group: Hashable = None  # which requests may share its run (Batcher's `group`)


@dataclass
class BatchRecord:
    """What one executed batch looked like, for metrics."""

    requests: int
    samples: int
    queue_times: list[float]
    run_time: float
    failed: bool


def samples_of(feeds: Feeds) -> int:
    """A request's batch size: the leading dimension of its first input (1 for scalars)."""
    first = next(iter(feeds.values()), None)
    return int(first.shape[0]) if first is not None and first.ndim else 1


# A lone request runs in the caller's thread (`run_now`) only while batches take less than
# this: the caller is a server's event loop, which answers nothing else meanwhile.
INLINE_RUN_S = 0.001
# Judged on the median of the last few batches: on a shared machine one batch in a few takes
# several times the rest, and a running mean then sent a fifth of resnet-tiny's lone
# requests to the worker.
RECENT_RUNS = 8


class Batcher:
    def __init__(
        self,
        run_batch: RunBatch,
        max_batch: int = 16,
        max_delay: float = 0.005,
        max_queue: int = 256,
        observe: Callable[[BatchRecord], None] | None = None,
        *,
        preferred: tuple[int, ...] = (),
        combine: bool = True,
        workers: int = 1,
        group: Callable[[Feeds], Hashable] | None = None,
    ) -> None:
        self._run_batch = run_batch
        self.max_batch, self.max_delay, self.max_queue = max_batch, max_delay, max_queue
        self.preferred, self.combine, self.workers = preferred, combine, max(1, workers)
        self.group = group
        self._observe = observe
        self._queue: deque[Job] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._running = 0  # batches being run, by the workers or by `run_now`
        self._recent: deque[float] = deque(maxlen=RECENT_RUNS)  # the last batches' seconds
        self._threads = [
            threading.Thread(target=self._loop, name="kiln-batcher", daemon=True)
            for _ in range(self.workers)
        ]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    @property
    def depth(self) -> int:
        return len(self._queue)

    @property
    def accepting(self) -> bool:
        return not self._closing and any(t.is_alive() for t in self._threads)

    def full(self) -> bool:
        return len(self._queue) >= self.max_queue

    def submit(self, feeds: Feeds) -> Future:
        """Queue one request; its future resolves to the outputs, in the model's order."""
        job = Job(feeds, samples_of(feeds), group=self.group(feeds) if self.group else None)
        with self._cond:
            if self._closing:
                raise Closed("the server is shutting down and takes no new requests")
            if len(self._queue) >= self.max_queue:
                raise Overloaded(
                    f"server overloaded: {len(self._queue)} requests are queued (the limit, "
                    "kiln serve --max-queue); retry later"
                )
            self._queue.append(job)
            self._cond.notify_all()  # with several workers, the one waiting for company too
        return job.future

    def run_now(self, feeds: Feeds) -> Future | None:
        """Run one request in this thread, its future done, where a worker would take it alone
        at once: no wait for company (max_delay 0 or no combining), nothing queued, a worker's
        place free, and batches shorter than INLINE_RUN_S. None otherwise: `submit` it."""
        if self.combine and self.max_delay > 0:
            return None
        job = Job(feeds, samples_of(feeds), group=self.group(feeds) if self.group else None)
        with self._cond:
            idle = not self._queue and self._running < self.workers and not self._closing
            if not idle or not self._short():
                return None
            self._running += 1  # what is submitted meanwhile waits for it, as for a worker's
        try:
            self._run([job])
        finally:
            with self._cond:
                self._running -= 1
                # Only for what came in meanwhile: a worker woken for nothing takes the GIL
                # from this thread (0.75 ms per request in a cProfile of resnet-tiny).
                if self._queue:
                    self._cond.notify()
        return job.future

    def _short(self) -> bool:
        """Whether recent batches ran in under INLINE_RUN_S (their median; none: not known)."""
        recent = sorted(self._recent)
        return bool(recent) and recent[len(recent) // 2] < INLINE_RUN_S

    def close(self, timeout: float | None = None) -> None:
        """Refuse new requests, finish the queued ones, stop the worker."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()  # every worker: each must see it to end
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout)

    def _loop(self) -> None:
        while (batch := self._take()) is not None:
            try:
                self._run(batch)
            finally:
                with self._cond:
                    self._running -= 1
                    if self._queue:  # a worker held back by `run_now`'s place may go now
                        self._cond.notify()

    def _take(self) -> list[Job] | None:
        """The next batch; None once closing and the queue is empty."""
        with self._cond:
            # A run in a caller's thread (`run_now`) holds a worker's place too.
            while not self._closing and (not self._queue or self._running >= self.workers):
                self._cond.wait()
            if not self._queue:
                return None
            self._running += 1  # given back by _loop once the batch has run
            if not self.combine:
                return [self._queue.popleft()]
            deadline = self._queue[0].enqueued + self.max_delay
            # Wait for company while there is room and time; when draining, don't wait.
            while not self._closing and not self._full(self._sizes()):
                left = deadline - time.perf_counter()
                if left <= 0:
                    break
                self._cond.wait(left)
            if self.group is not None:
                return self._take_group()
            return [self._queue.popleft() for _ in range(self._count(self._sizes()))]

    def _take_group(self) -> list[Job]:
        """The oldest request and the queued ones of its group, in order, within max_batch."""
        group = self._queue[0].group
        chosen, total = [], 0
        for job in self._queue:
            if job.group == group and (not chosen or total + job.samples <= self.max_batch):
                chosen.append(job)
                total += job.samples
        taken = {id(job) for job in chosen}  # by identity: a Job's == compares its arrays
        self._queue = deque(job for job in self._queue if id(job) not in taken)
        return chosen

    def _sizes(self) -> list[int]:
        """The samples of each batch the queue can form from its oldest requests, in order
        and within max_batch (the first request counts even beyond it: it then runs alone)."""
        sizes, total = [], 0
        for job in self._queue:
            total += job.samples
            if sizes and total > self.max_batch:
                break
            sizes.append(total)
        return sizes

    def _full(self, sizes: list[int]) -> bool:
        """Whether to stop waiting: max_batch reached, or a preferred size can be formed."""
        queued = sum(job.samples for job in self._queue)
        return queued >= self.max_batch or any(s in self.preferred for s in sizes)

    def _count(self, sizes: list[int]) -> int:
        """How many requests the next batch takes: those of the largest preferred size the
        queue forms (Triton's rule), else as many as fit."""
        preferred = [i for i, s in enumerate(sizes) if s in self.preferred]
        return preferred[-1] + 1 if preferred else len(sizes)

    def _run(self, batch: list[Job]) -> None:
        start = time.perf_counter()
        failed = False
        try:
            results = self._run_batch([job.feeds for job in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"run_batch gave {len(results)} results for {len(batch)}")
        except Exception as exc:  # every error goes back to its request
            failed = True
            if len(batch) == 1:
                batch[0].future.set_exception(exc)
            else:
                # One bad request must not fail its neighbours: run each alone.
                for job in batch:
                    try:
                        job.future.set_result(self._run_batch([job.feeds])[0])
                    except Exception as one:
                        job.future.set_exception(one)
        else:
            for job, outputs in zip(batch, results, strict=True):
                job.future.set_result(outputs)
        run_time = time.perf_counter() - start
        self._recent.append(run_time)  # one append: atomic, whichever worker ran it
        if self._observe is not None:
            self._observe(  # metrics only: must not raise
                BatchRecord(
                    requests=len(batch),
                    samples=sum(job.samples for job in batch),
                    queue_times=[start - job.enqueued for job in batch],
                    run_time=run_time,
                    failed=failed,
                )
            )
