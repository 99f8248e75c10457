"""`TuneConfig`: what a user asks of one tuning run, as a plain record — what `kiln tune`'s
flags are generated from — and `plan_of`, which turns it into the `Plan` every worker of the
study shares (kiln.tune.study).

Its defaults are `plan_for`'s own (a test holds them equal); they are written here rather
than read from it so that `kiln --help` does not import Optuna.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from kiln.config import CompileConfig

LIMITS = ("max_p50", "max_p99", "max_jitter", "max_memory", "min_throughput")


@dataclass(frozen=True)
class TuneConfig:
    """How a study searches, what it optimizes and under which limits."""

    objective: tuple[str, ...] = ("latency",)
    """latency (P50), p99, jitter ((P99−P50)/P50), throughput (samples/s, batch and
    concurrency searched too) or memory; repeat (or comma-separate) for a Pareto front, the
    first one picks."""
    max_p50: str | None = None
    """Constraint with its unit (us, ms, s), e.g. 20ms."""
    max_p99: str | None = None
    """Constraint with its unit (us, ms, s), e.g. 50ms."""
    max_jitter: str | None = None
    """Constraint, e.g. 0.2."""
    max_memory: str | None = None
    """Constraint on the session's peak resident memory (measured in a process of its own),
    with its unit (kB, MB, GB decimal; KiB, MiB, GiB binary), e.g. 2GiB."""
    min_throughput: str | None = None
    """Constraint (samples/s)."""
    clients: int = 0
    """With the throughput objective: measure it served to this many concurrent clients,
    each sending one-sample requests through the dynamic batcher, and search the batcher's
    max batch and delay (kiln serve --max-batch/--max-delay-ms, which serve then takes from
    the artifact) instead of batch and streams."""
    traffic: str | None = None
    """With clients: the request shapes production sends, as JSON (a file, or the JSON
    itself) — a list of requests giving each dynamic dim a size, e.g. '[{"seq": 12},
    {"batch": 4, "seq": 128}]' (batch defaults to 1) — or served:NAME, the shapes kiln serve
    --feedback recorded for NAME. The clients replay them through a kiln.Session, and the
    bucket sets proposed from them (0–8 sizes per dim) are searched too; the pick's set is
    written into the artifact, where kiln serve takes it."""
    trials: int = 30
    """Finished trials the study should hold."""
    seconds: float | None = None
    """The whole command's time, confirmation included, e.g. 15m: trials start until a
    quarter of it (at most 30 s) is left, which the confirmation then uses."""
    storage: str | None = None
    """Study and strategy-library database URL (default: sqlite under KILN_HOME;
    postgresql+psycopg://... shares one study between machines)."""
    study: str | None = None
    """Study name (default: MODEL-OBJECTIVE-HARDWARE); reuse it to resume."""
    workers: int = 1
    """Worker processes sharing the study."""
    stale_after: int = 60
    """Seconds without a heartbeat after which a worker's trial is failed and retried by the
    others (a crashed or killed worker)."""
    engines: tuple[str, ...] | None = None
    """Engines to search, e.g. ort,openvino (default: all)."""
    precisions: tuple[str, ...] | None = None
    """Precisions to search, e.g. fp32,int8 (default: all)."""
    seconds_per_trial: float = 3.0
    """Measuring time per trial (s), beyond building it."""
    confirm_runs: int = 1000
    """Runs of the final tuned-vs-defaults confirmation, each side."""
    warm_start: bool = True
    """Start from the winners of the nearest models in the library."""
    seed: int | None = None
    """Sampler seed (reproducible suggestions)."""

    def replace(self, **changes: Any) -> TuneConfig:
        return dataclasses.replace(self, **changes)


def plan_of(source: str, config: TuneConfig, base: CompileConfig | None = None) -> Any:
    """The study's `Plan` for `source` (kiln.tune.study.plan_for): `base` the compile
    decisions every trial keeps (metric, budget, calibration, inputs); bad values refused
    here, before any work."""
    from kiln.errors import KilnError
    from kiln.tune.objectives import parse_constraint, parse_objectives
    from kiln.tune.study import plan_for

    if config.workers < 1:
        raise KilnError(f"--workers {config.workers}: use at least 1.")
    if config.seconds_per_trial <= 0:
        raise KilnError(f"--seconds-per-trial {config.seconds_per_trial:g}: give a positive time.")
    limits = {name: getattr(config, name) for name in LIMITS}
    return plan_for(
        source, objectives=parse_objectives(list(config.objective)),
        constraints=[parse_constraint(k, v) for k, v in limits.items() if v is not None],
        base=base or CompileConfig(), trials=config.trials, timeout_s=config.seconds,
        url=config.storage, study=config.study, seconds_per_trial=config.seconds_per_trial,
        engines=list(config.engines) if config.engines else None,
        precisions=list(config.precisions) if config.precisions else None, seed=config.seed,
        confirm_runs=config.confirm_runs, stale_after_s=config.stale_after,
        clients=config.clients, traffic=config.traffic,
    )  # fmt: skip
