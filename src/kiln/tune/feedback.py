"""The feedback loop: production traffic tunes the running model.

A `FeedbackLoop` on a live session (`kiln.Session(..., feedback=True)`, or `kiln serve
--feedback`) cuts the traffic into
windows (latency percentiles, batch and shape histograms, padding waste, queue depth, CPU use)
and stores them; each cycle diagnoses the window's bottleneck and proposes named strategies
with their evidence (overhead-bound → fewer threads, no spinning; bursts of large batches →
the throughput configuration; jitter → pinned threads or one stream). Each is built off the
request path on a twin session, checked against the live outputs, A/B-measured interleaved
on the recent requests replayed, and hot-swapped in (`LocalSession.reconfigure`) only when it
improves the objective by `min_gain` beyond noise. Adopted and refused strategies, with their
evidence and measurements, go to the strategy library (`kiln strategies list`).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from kiln.artifact.parts import is_partitioned
from kiln.errors import KilnError
from kiln.runtime import LocalSession
from kiln.tune.measure import duel

Say = Callable[[str], None]
MIN_REQUESTS = 20  # a window with fewer says nothing about the traffic
REPLAY = 32  # recent requests replayed per A/B round
KEEP_REQUESTS = 256  # recent requests a session with feedback keeps, unless told otherwise


@dataclass(frozen=True)
class Strategy:
    name: str
    options: dict[str, Any]  # engine options on top of the current ones
    why: str  # the evidence that proposed it
    buckets: dict[str, list[int]] | None = None  # a new bucket set (None: keep the current)


@dataclass
class Window:
    start: float
    end: float
    requests: int
    p50_ms: float
    p99_ms: float
    jitter: float
    mean_batch: float
    batches: dict[int, int]
    shapes: dict[str, int]
    dims: dict[str, dict[int, int]]  # per dynamic dim: how many requests had each value
    padding_waste: float
    queue_depth: int | None
    cpu_percent: float  # of the whole machine

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def window_of(session: LocalSession, since: int, start: float, cpu: float,
              queue_depth: int | None) -> tuple[Window | None, int]:  # fmt: skip
    """The observations the session's monitor made after the cursor `since`: a Window (None
    when too few, which then count towards the next) and the new cursor."""
    new, cursor = session.monitor.since(since)
    if len(new) < MIN_REQUESTS:
        return None, since
    ms = sorted(o.seconds * 1e3 for o in new)
    batch_of = lambda o: math.prod(o.dims.get(d, 1) for d in session.batch_dims) or 1  # noqa: E731
    batches = Counter(batch_of(o) for o in new)
    shapes = Counter(",".join(f"{k}={v}" for k, v in sorted(o.dims.items())) for o in new)
    dims: dict[str, Counter] = {}
    for o in new:
        for dim, value in o.dims.items():
            dims.setdefault(dim, Counter())[value] += 1
    p50, p99 = _percentile(ms, 50), _percentile(ms, 99)
    real, executed = sum(o.real for o in new), sum(o.executed for o in new)
    return Window(
        start=start, end=time.time(), requests=len(new), p50_ms=p50, p99_ms=p99,
        jitter=(p99 - p50) / p50 if p50 else 0.0,
        mean_batch=sum(b * n for b, n in batches.items()) / len(new),
        batches=dict(batches), shapes=dict(shapes.most_common(10)),
        dims={d: dict(c.most_common(16)) for d, c in dims.items()},
        padding_waste=1 - real / executed if executed else 0.0,
        queue_depth=queue_depth, cpu_percent=cpu,
    ), cursor  # fmt: skip


def _percentile(sorted_ms: list[float], q: float) -> float:
    index = min(len(sorted_ms) - 1, max(0, math.ceil(q / 100 * len(sorted_ms)) - 1))
    return sorted_ms[index]


WASTE = 0.25  # padding above this share of the work asks for new buckets
COMMON = 0.10  # a dim value this share of the requests has earns its own bucket


def rebucket(window: Window, buckets: dict[str, list[int]]) -> Strategy | None:
    """New buckets when padding wastes more than WASTE: every dim value COMMON in the window
    gets a bucket of its own (the current ones stay, for the traffic that still needs them)."""
    if window.padding_waste <= WASTE or not buckets:
        return None
    proposed = {}
    for dim, sizes in buckets.items():
        seen = window.dims.get(dim, {})
        common = {int(v) for v, n in seen.items() if n >= COMMON * window.requests}
        proposed[dim] = sorted(set(sizes) | common)
    if proposed == buckets:
        return None
    added = {d: sorted(set(v) - set(buckets[d])) for d, v in proposed.items() if v != buckets[d]}
    return Strategy(
        "rebucket", {}, f"padding wastes {window.padding_waste:.0%} of the work; common sizes "
        f"{added} have no bucket of their own", buckets=proposed,
    )  # fmt: skip


def diagnose(
    window: Window, options: dict[str, Any], engine: str,
    buckets: dict[str, list[int]] | None = None,
) -> list[Strategy]:  # fmt: skip
    """Named strategies for the window's bottleneck, each with its evidence, the surest
    first (padding is measured waste; thread counts depend on what else runs)."""
    cores = os.cpu_count() or 1
    out = [s for s in [rebucket(window, buckets or {})] if s is not None]
    if engine == "ort":
        threads = options.get("intra_op_threads") or cores
        if window.mean_batch >= 4 and threads < cores:
            out.append(Strategy(
                "throughput-config", {"intra_op_threads": cores, "spinning": True},
                f"bursts of large batches (mean batch {window.mean_batch:.1f} over "
                f"{window.requests} requests) on {threads} of {cores} threads",
            ))  # fmt: skip
        if window.mean_batch <= 1.5 and window.p50_ms < 1.0 and threads > 1:
            out.append(Strategy(
                "fewer-threads", {"intra_op_threads": 1, "spinning": False},
                f"overhead-bound: batch {window.mean_batch:.1f}, P50 {window.p50_ms:.2f} ms on "
                f"{threads} threads",
            ))  # fmt: skip
        if window.jitter > 1.0 and options.get("spinning", True):
            out.append(Strategy(
                "steady-no-spin", {"spinning": False},
                f"jitter {window.jitter:.1f} (P99 {window.p99_ms:.2f} ms vs P50 "
                f"{window.p50_ms:.2f} ms) with spinning thread pools",
            ))  # fmt: skip
    elif engine == "openvino":
        if window.mean_batch >= 4 and options.get("performance_hint") != "THROUGHPUT":
            out.append(Strategy(
                "throughput-config", {"performance_hint": "THROUGHPUT"},
                f"bursts of large batches (mean batch {window.mean_batch:.1f})",
            ))  # fmt: skip
        if window.jitter > 1.0 and options.get("num_streams") != 1:
            out.append(Strategy(
                "one-pinned-stream",
                {"num_streams": 1, "extra": {**options.get("extra", {}),
                                             "ENABLE_CPU_PINNING": "YES"}},
                f"jitter {window.jitter:.1f} with {options.get('num_streams') or 'auto'} streams",
            ))  # fmt: skip
    return out


@dataclass
class Outcome:
    strategy: Strategy
    adopted: bool
    gain: float | None  # objective improvement measured (0.25 = 25 % better)
    interval: tuple[float, float] | None
    reason: str
    measurement: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "strategy": asdict(self.strategy)}


class FeedbackLoop:
    """See the module docstring. `objective`: latency (P50 per request, replayed) or
    throughput (samples/s over the replay); `min_gain`: the improvement a strategy must show
    (0.10 = 10 %); `library_url`: where windows and outcomes are stored (None: not stored)."""

    def __init__(
        self, session: LocalSession, *, objective: str = "latency", min_gain: float = 0.10,
        interval_s: float = 30.0, seconds: float = 3.0, cooldown_s: float = 300.0,
        library_url: str | None = None, queue_depth: Callable[[], int] | None = None,
        model: str | None = None, say: Say = lambda _m: None,
    ) -> None:  # fmt: skip
        if objective not in ("latency", "throughput"):
            raise KilnError(f"feedback objective '{objective}': use latency or throughput.")
        if not session.keep_requests:
            raise KilnError(
                "the feedback loop replays recent requests: open the session with "
                "keep_requests > 0 (kiln.Session(..., feedback=True) does)."
            )
        self.session, self.objective, self.min_gain = session, objective, min_gain
        self.interval_s, self.seconds, self.cooldown_s = interval_s, seconds, cooldown_s
        self.queue_depth, self.say = queue_depth, say
        self.model = model or _model_name(session)
        self.library = None
        if library_url is not None:
            from kiln.tune.library import Library

            self.library = Library(library_url)
        self.windows: list[Window] = []
        self.outcomes: list[Outcome] = []
        self._refused: dict[str, float] = {}  # strategy name → when
        self._seen, self._started = 0, time.time()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        psutil.cpu_percent(interval=None)  # the next call measures from here

    # ---------------------------------------------------------------- the cycle

    def cycle(self) -> list[Outcome]:
        """One pass: the window since the last, its diagnosis, each proposal tried."""
        cpu = psutil.cpu_percent(interval=None)
        depth = self.queue_depth() if self.queue_depth is not None else None
        window, self._seen = window_of(self.session, self._seen, self._started, cpu, depth)
        self._started = time.time()
        if window is None:
            return []
        self.windows.append(window)
        if self.library is not None:
            self.library.add_window(self._model(), window.to_json())
        engine = self.session.get_providers()[0]
        engine = "openvino" if engine.startswith("OpenVINO") else "ort"
        outcomes = []
        for strategy in diagnose(window, self.session.options, engine, self.session.buckets):
            refused_at = self._refused.get(strategy.name)
            if refused_at is not None and time.time() - refused_at < self.cooldown_s:
                continue
            outcome = self.try_strategy(strategy)
            outcomes.append(outcome)
            if outcome.adopted:
                break  # the next window judges the new configuration
        return outcomes

    def try_strategy(self, strategy: Strategy) -> Outcome:
        """Build, check and A/B-measure `strategy` on replayed traffic; adopt it only when
        the objective improves by `min_gain` beyond noise."""
        self.say(f"feedback: trying {strategy.name} ({strategy.why})")
        replay = self.session.recent_requests()[-REPLAY:]
        if not replay:
            return self._record(Outcome(strategy, False, None, None, "no recent requests"))
        try:
            current = self.session.twin()
            candidate = self.session.twin(strategy.options, strategy.buckets)
        except KilnError as exc:
            return self._record(Outcome(strategy, False, None, None, f"does not build: {exc}"))
        try:
            fight = duel(_replayer(candidate, replay), _replayer(current, replay),
                         seconds=self.seconds, runs=3, min_rounds=4, tight=0.03)  # fmt: skip
        finally:
            current.close()
            candidate.close()
        # ratio = candidate / current time per replay: below 1 is faster (both objectives:
        # the replay is the same requests, so time and samples/s are reciprocal)
        gain, low, high = (
            1 / fight.ratio.value - 1,
            1 / fight.ratio.high - 1,
            1 / fight.ratio.low - 1,
        )
        measured = {"ratio": fight.ratio.to_json(), "rounds": fight.rounds,
                    "replayed_requests": len(replay)}  # fmt: skip
        if gain >= self.min_gain and low > 0:
            try:
                self._adopt(strategy)
            except KilnError as exc:
                return self._record(Outcome(strategy, False, gain, (low, high), str(exc), measured))
            reason = f"{self.objective} {gain:+.0%} ({low:+.0%}..{high:+.0%}) on replayed traffic"
            return self._record(Outcome(strategy, True, gain, (low, high), reason, measured))
        reason = (
            f"{self.objective} {gain:+.0%} ({low:+.0%}..{high:+.0%}) on replayed traffic, below "
            f"the {self.min_gain:.0%} needed beyond noise"
        )
        return self._record(Outcome(strategy, False, gain, (low, high), reason, measured))

    def _adopt(self, strategy: Strategy) -> None:
        """Hot-swap the strategy in: engine options by `reconfigure`, buckets by the
        session's verified background swap. KilnError when either refuses."""
        if strategy.options:
            self.session.reconfigure(strategy.options, reason=f"feedback: {strategy.name}")
        if strategy.buckets:
            self.session.swap(strategy.buckets, wait=True)
            if self.session.buckets != strategy.buckets:
                raise KilnError(f"the bucket swap to {strategy.buckets} did not verify")

    def _record(self, outcome: Outcome) -> Outcome:
        self.outcomes.append(outcome)
        verb = "adopted" if outcome.adopted else "refused"
        self.say(f"feedback: {verb} {outcome.strategy.name}: {outcome.reason}")
        if not outcome.adopted:
            self._refused[outcome.strategy.name] = time.time()
        if self.library is not None:
            from kiln.tune.library import Record
            from kiln.tune.signature import hardware

            gains = {} if outcome.gain is None else {"gain": outcome.gain,
                                                      "interval": outcome.interval}  # fmt: skip
            self.library.add(Record(
                verb, hardware(), self._model(), {}, f"feedback-{self.objective}", {},
                {"engine_options": outcome.strategy.options,
                 "buckets": outcome.strategy.buckets}, gains, [],
                {"strategy": outcome.strategy.name, "why": outcome.strategy.why,
                 "reason": outcome.reason, "measurement": outcome.measurement,
                 "window": self.windows[-1].to_json() if self.windows else None},
            ))  # fmt: skip
        return outcome

    def _model(self) -> str:
        return self.model

    # ---------------------------------------------------------------- the thread

    def start(self) -> FeedbackLoop:
        self._thread = threading.Thread(target=self._loop, name="kiln-feedback", daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.cycle()
            except Exception as exc:  # the loop must never take the server down
                self.say(f"feedback: cycle failed ({type(exc).__name__}: {exc}); next window")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)


def check_tunable(path_or_model: Any, remote: str | None) -> None:
    """KilnError, before anything is opened, unless `path_or_model` opens as a model run here:
    the loop reconfigures and swaps a LocalSession's engine and buckets."""
    if remote is not None:
        raise KilnError(
            "feedback=True tunes a model run here; the server part of a split is tuned where "
            "it is served (kiln serve --feedback there). Open the edge part without feedback."
        )
    if isinstance(path_or_model, str | Path) and is_partitioned(path_or_model):
        raise KilnError(
            f"{path_or_model} is a partitioned artifact: kiln.Session does not offer the "
            "feedback loop on one yet. Open it without, or build it with --partition none."
        )


def _model_name(session: LocalSession) -> str:
    """The name records are kept under: the artifact's source model, else the graph's."""
    if session.artifact is not None:
        return session.artifact.manifest.source.name
    return session.interface.graph.name or "model"


def _replayer(session: LocalSession, replay: list[dict]) -> Callable[[], None]:
    def run() -> None:
        for feeds in replay:
            session.run(None, feeds)

    return run


__all__ = ["FeedbackLoop", "Outcome", "Strategy", "Window", "check_tunable", "diagnose"]
