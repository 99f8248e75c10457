"""One worker's bench: builds a trial's choice (passes and precision cached per compile key,
the runtime options applied on top and verified again), and measures it against the
incumbent — the best choice this worker has measured, the defaults to begin with."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from kiln.backends import get_backend
from kiln.compiler.api import save_result
from kiln.compiler.candidate import CompileResult, compile_candidate, engine_options
from kiln.compiler.passes_stage import Target, verify_on
from kiln.config import CompileConfig
from kiln.errors import KilnError
from kiln.ir.inputs import feed_dims, named_dims, synthesize
from kiln.ir.load import LoadedModel
from kiln.runtime.buckets import propose
from kiln.runtime.footprint import peak_memory
from kiln.timing import Interval, bootstrap, time_runs
from kiln.tune.measure import duel, tails
from kiln.tune.objectives import Constraint, Objective
from kiln.tune.serving import Served, merged_runner, serve
from kiln.tune.space import Choice
from kiln.tune.traffic import Shape, dynamic_dims, traffic_feeds

Say = Callable[[str], None]
Feeds = dict[str, np.ndarray]


class Refused(Exception):
    """The choice builds no verified artifact (the reason is the message)."""


@dataclass
class Built:
    choice: Choice
    result: CompileResult  # its model, config and options are the choice's
    runners: list[Callable[[], object]]  # one per concurrent stream
    memory_mib: float | None = None  # peak of its session, alone (see `footprint`); None: not yet
    feeds: Feeds = field(default_factory=dict)  # one run's inputs
    served: Callable[..., Served] | None = None  # served(seconds=...): a window served
    buckets: dict[str, list[int]] = field(default_factory=dict)  # the served bucket set


@dataclass
class Measured:
    built: Built
    measures: dict[str, float]
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass
class Workbench:
    loaded: LoadedModel
    base: CompileConfig
    objectives: list[Objective]
    constraints: list[Constraint]
    seconds: float  # measuring time per trial
    given: list[Feeds] | None = None
    given_source: str = "given inputs"
    say: Say = lambda _m: None
    traffic: list[Shape] | None = None  # served: the recorded request shapes to replay
    _compiled: dict[tuple, CompileResult | str] = field(default_factory=dict)
    incumbent: Measured | None = None

    @property
    def needs_latency(self) -> bool:
        keys = {o.measure for o in self.objectives} | {c.measure for c in self.constraints}
        return bool(keys & {"p50_ms", "p99_ms", "jitter"})

    @property
    def needs_tails(self) -> bool:
        keys = {o.measure for o in self.objectives} | {c.measure for c in self.constraints}
        return bool(keys & {"p99_ms", "jitter"})

    @property
    def needs_throughput(self) -> bool:
        keys = {o.measure for o in self.objectives} | {c.measure for c in self.constraints}
        return "throughput" in keys

    @property
    def needs_memory(self) -> bool:
        keys = {o.measure for o in self.objectives} | {c.measure for c in self.constraints}
        return "memory_mib" in keys

    def build(self, choice: Choice) -> Built:
        """The choice compiled and verified with its runtime options, or Refused."""
        result = self._compile(choice)
        config = choice.config
        feeds = self._feeds(result, choice.batch)
        runtime = dict(choice.runtime)
        if config.static:  # compiled dynamic (see _compile), run static at the trial's dims
            runtime["dim_overrides"] = feed_dims(result.model, feeds)
        options = engine_options(config.engine, config.precision, runtime)
        target = Target(
            config.engine, options, config.precision, result.feeds, result.reference,
            result.verification.inputs if result.verification else "synthesized",
            budget=config.budget(),
        )  # fmt: skip
        verification, exe = verify_on(result.model, target)
        if not verification.ok:
            raise Refused(f"with its runtime options: {verification.summary()}")
        exes = [exe] + [
            get_backend(config.engine).compile(result.model, options)
            for _ in range(choice.concurrency - 1)
        ]
        runners = [partial(e.run, feeds) for e in exes]
        for run in runners:
            run()
        built = replace(result, config=config, options=options)
        out = Built(choice, built, runners, feeds=feeds)
        if self.needs_memory:
            footprint(out)
        if choice.clients and self.traffic:
            out.served, out.buckets = self._session_server(out)
        elif choice.clients:
            out.served = partial(serve, merged_runner(exe.run), [self._feeds(result, 1)],
                                 clients=choice.clients, max_batch=choice.batch,
                                 max_delay_ms=choice.max_delay_ms)  # fmt: skip
        return out

    def _session_server(self, built: Built) -> tuple[Callable[..., Served], dict[str, list[int]]]:
        """Serving as `kiln serve` runs the artifact: a `kiln.Session` (its buckets proposed
        from the traffic, `buckets_per_dim` sizes per dim, verified) under the batcher, the
        traffic's requests replayed. The trial's artifact lives as long as `built`."""
        from kiln.runtime import Session

        assert self.traffic is not None
        choice, model = built.choice, built.result.model
        where = Path(tempfile.mkdtemp(prefix="kiln-tune-served-"))
        try:
            session = Session(save_result(built.result, where / "trial.kiln").path, buckets={})
        except BaseException:
            shutil.rmtree(where, ignore_errors=True)
            raise
        weakref.finalize(built, _discard, session, where)
        buckets: dict[str, list[int]] = {}
        if choice.buckets_per_dim:
            dims = [d for d in dynamic_dims(model) if d not in session.batch_dims]
            paddable = {d: session.verdict(d).allowed for d in dims}
            buckets = propose(self.traffic, dims, paddable, choice.buckets_per_dim)
            session.swap(buckets, wait=True)
            if session.buckets != buckets:
                raise Refused(f"the bucket set {buckets} did not build and verify")
        requests = traffic_feeds(model, self.traffic)
        session.run_batch(requests[: choice.batch])  # warm: first runs are not the measure
        served = partial(serve, session.run_batch, requests, clients=choice.clients,
                         max_batch=choice.batch, max_delay_ms=choice.max_delay_ms)  # fmt: skip
        return served, buckets

    def _compile(self, choice: Choice) -> CompileResult:
        key = choice.compile_key
        if key not in self._compiled:
            config = choice.config.replace(engine_options={}, static=False)
            try:
                result = compile_candidate(
                    self.loaded, config, self.given, self.given_source, say=self.say
                )
                self._compiled[key] = result if result.ok else result.verification.summary()
            except KilnError as exc:
                self._compiled[key] = str(exc)
        found = self._compiled[key]
        if isinstance(found, str):
            raise Refused(found)
        return found

    def _feeds(self, result: CompileResult, batch: int) -> Feeds:
        feeds = result.feeds[0] if result.feeds else synthesize(result.loaded.model)
        if batch == 1:
            return feeds
        dim = batch_dim(result.loaded.model)
        if dim is None:
            raise Refused("the model has no dynamic batch dim to batch on")
        return synthesize(result.loaded.model, shapes={**dict(self.base.shapes), dim: (batch,)})

    def measure(self, built: Built) -> Measured:
        """Against the incumbent (which it replaces when better on the first objective)."""
        if self.incumbent is None:
            self.incumbent = self._alone(built)
            return self.incumbent
        incumbent, measures, evidence = self.incumbent, self._memory(built), {}
        if self.needs_latency:
            fight = duel(built.runners[0], incumbent.built.runners[0], seconds=self.seconds,
                         min_runs=150 if self.needs_tails else 0, give_up_above=1.5)  # fmt: skip
            mine, theirs = tails(fight.trial_s), tails(fight.incumbent_s)
            base = incumbent.measures
            measures["p50_ms"] = base["p50_ms"] * fight.ratio.value
            measures["p99_ms"] = base["p99_ms"] * mine.p99_ms.value / theirs.p99_ms.value
            measures["jitter"] = mine.jitter.value
            evidence |= {"vs_incumbent": fight.to_json(), "tails": mine.to_json()}
        if self.needs_throughput:
            ratio = rate_duel(built, incumbent.built, self.seconds)
            measures["throughput"] = incumbent.measures["throughput"] * ratio.value
            evidence["throughput_vs_incumbent"] = ratio.to_json()
            if built.served is not None:
                evidence["served"] = _served_evidence(built)
        measured = Measured(built, measures, evidence)
        first = self.objectives[0]
        if self._feasible(measured) and first.better(
            measures[first.measure], incumbent.measures[first.measure]
        ):
            self.incumbent = measured
        return measured

    def _alone(self, built: Built) -> Measured:
        """The first choice, measured on its own: the base every later ratio is taken from."""
        measures, evidence = self._memory(built), {}
        if self.needs_latency:
            seconds = time_runs(
                built.runners[0], max(200, 3 * 50), seconds=self.seconds * 2, at_least=20
            )
            alone = tails(seconds)
            measures |= {
                "p50_ms": alone.p50_ms.value,
                "p99_ms": alone.p99_ms.value,
                "jitter": alone.jitter.value,
            }
            evidence["tails"] = alone.to_json()
        if self.needs_throughput:
            measures["throughput"] = throughput(built, _window(built))
        return Measured(built, measures, evidence)

    def _memory(self, built: Built) -> dict[str, float]:
        return {"memory_mib": footprint(built)} if self.needs_memory else {}

    def _feasible(self, measured: Measured) -> bool:
        return all(c.violation(measured.measures) <= 0 for c in self.constraints)


def _discard(session: Any, where: Path) -> None:
    session.close()
    shutil.rmtree(where, ignore_errors=True)


def batch_dim(model: Any) -> str | None:
    """The name of the first input's leading dim, when it is symbolic."""
    for value in model.graph.inputs:
        if value.name in model.graph.initializers:
            continue
        dims = named_dims(value)
        return dims[0][1] if dims and dims[0][0] == 0 else None
    return None


def footprint(built: Built) -> float:
    """The peak resident memory (MiB) of the built choice's session in a process of its own,
    opened and run on its feeds — `kiln.runtime.footprint.peak_memory`, the figure `kiln
    bench` reports — never the growth of this process, which holds every other build too.
    One session: concurrent streams share the weights' file, not counted again."""
    if built.memory_mib is None:
        with tempfile.TemporaryDirectory(prefix="kiln-tune-memory-") as where:
            path = save_result(built.result, Path(where) / "trial.kiln").path
            built.memory_mib = peak_memory(path, built.feeds, runs=5)["peak_mib"]
    return built.memory_mib


def _window(built: Built) -> float:
    """A throughput window: a second, or three batches where one takes longer."""
    begin = time.perf_counter()
    built.runners[0]()
    return max(1.0, 3 * (time.perf_counter() - begin))


def rate(runners: list[Callable[[], object]], batch: int, seconds: float) -> float:
    """Samples per second with one thread per runner, all running for `seconds`."""
    done = [0] * len(runners)
    deadline = time.perf_counter() + seconds

    def loop(index: int) -> None:
        while time.perf_counter() < deadline:
            runners[index]()
            done[index] += 1

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(len(runners))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) * batch / (time.perf_counter() - start)


def throughput(built: Built, seconds: float) -> float:
    """Samples per second: served to the choice's clients, else on its streams."""
    if built.served is not None:
        return built.served(seconds=seconds).rate
    return rate(built.runners, built.choice.batch, seconds)


def _served_evidence(built: Built) -> dict[str, float]:
    """One short served window's shape: how full the batches ran, the requests' P99."""
    assert built.served is not None
    served = built.served(seconds=_window(built))
    requests = len(served.latencies_s)
    return {"rate": served.rate, "p99_ms": served.p99_ms,
            "requests_per_batch": requests / max(served.batches, 1)}  # fmt: skip


def rate_duel(trial: Built, incumbent: Built, seconds: float) -> Interval:
    """Throughput ratio trial / incumbent over alternating windows, with its interval."""
    window, ratios, start = max(_window(trial), _window(incumbent)), [], time.perf_counter()
    while len(ratios) < 3 or time.perf_counter() - start < seconds:
        mine = throughput(trial, window)
        theirs = throughput(incumbent, window)
        ratios.append(mine / theirs if theirs else float("inf"))
        if len(ratios) >= 3 and bootstrap(ratios).halfwidth <= 0.02:
            break
    return bootstrap(ratios)
