"""`kiln.train.tune`: the fastest TrainConfig for a model at a FIXED global batch, searched by
an Optuna study on kiln tune's storage and remembered in its strategy library.

    result = tune("kiln.train.examples:byte_lm_small", "kiln.train.examples:stdlib_text_small",
                  base=TrainConfig(), global_batch=32, seconds=900, trials=12,
                  max_memory_mib=2048, output="train.json")
    config = read_config("train.json")

The search: precision (bf16 only where the CPU has bf16 kernels), micro_batch × accumulation
(divisors of the global batch), activation checkpointing, torch.compile, strategy × ranks
(ddp on 2 ranks where the cores allow), threads per rank, loader workers and prefetch. The
first trial is the user's `base`; then the winners of the nearest models on this training
hardware class; then Optuna's TPE.

How a trial is judged:
- it runs in a process of its own (`python -m kiln.train.trial`): `probe_steps` optimizer
  steps with `fit`, from the config's seed, on the same data; samples/s is the steady state
  after WARMUP_STEPS;
- a watchdog polls the trial's process tree every POLL_S and kills the tree past
  `max_memory_mib`: an out-of-memory verdict by measurement, never by an error string;
- before it runs, a config predicted over PREDICT_MARGIN × the limit by the trials measured
  so far (peak ≈ a + b·micro_batch per precision, checkpointing and ranks) is skipped;
- it must train as well as the base: its mean loss over the last third of the steps at most
  LOSS_TOLERANCE (relative) above the base's, else it is rejected with both figures.
The pick then runs against the base in alternating child runs (≥ CONFIRM_ROUNDS each) and is
adopted only when faster beyond their spread.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import math
import os
import pickle
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import types
import uuid
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.errors import KilnError
from kiln.train.config import TrainConfig
from kiln.train.trial import MARK

Say = Callable[[str], None]
LOSS_TOLERANCE = 0.02  # a trial's late loss may be this much (relative) above the base's
PROBE_STEPS = 20
WARMUP_STEPS = 2  # steps left out of samples/s: compilation, first allocations, loader start
TRIALS = 12
POLL_S = 0.05  # the watchdog's period under a memory cap
# ... and without one (the peak is still read: VmHWM misses no spike of the trial's root).
# Each poll walks /proc and reads every descendant's USS: at 20 Hz that took ≈ 20 % of a core
# from the trials it measures on a 2-core machine.
POLL_UNCAPPED_S = 0.5
PREDICT_MARGIN = 1.2  # skip a config predicted above this × --max-memory (the model is rough)
CONFIRM_ROUNDS = 2  # child runs of each side in the confirmation, alternating who goes first
CONFIRM_SHARE = 0.25  # of `seconds` kept for the confirmation, as kiln tune keeps
MAX_ACCUMULATION = 32  # micro-batches per step: beyond this the per-step overhead dominates
IDLE_ASKS = 20  # suggestions in a row that need no run (duplicates, predicted over) end it
TRIAL_FLOOR_S = 300.0  # without `seconds`: a trial may take this, or 10 × the base, at least
MIB = 2**20
BASE_BEST = "the base measured best"


# ------------------------------------------------------------------------------ the space


@dataclass(frozen=True)
class Space:
    """The knobs searched, each an Optuna categorical over `choices`, around `base`."""

    base: TrainConfig
    global_batch: int
    cores: int
    choices: dict[str, tuple[Any, ...]]

    @classmethod
    def build(cls, base: TrainConfig, global_batch: int, cores: int, features: list[str],
              blocks: int, narrow: dict[str, list[Any]] | None = None) -> Space:  # fmt: skip
        bf16 = {"avx512_bf16", "amx_bf16"} & set(features)  # elsewhere bf16 is emulated
        choices: dict[str, tuple[Any, ...]] = {
            "precision": ("fp32", *(("bf16",) if bf16 else ()), "fp16"),
            "micro_batch": tuple(d for d in range(1, global_batch + 1) if global_batch % d == 0
                                 and global_batch // d <= MAX_ACCUMULATION),
            "checkpointing": ("none", "every", "full") if blocks >= 2 else ("none",),
            "compile": ("off", "default"),
            "parallel": ("single-1", *(("ddp-2",) if cores >= 2 else ())),  # one core a rank
            "threads": tuple(sorted({2**i for i in range(cores.bit_length()) if 2**i <= cores}
                                    | {cores})),
            "workers": (0, 1),
            "prefetch": (2, 4),
        }  # fmt: skip
        for name, values in (narrow or {}).items():
            if name not in choices:
                raise KilnError(f"space: unknown knob '{name}'; the knobs are "
                                f"{', '.join(choices)}.")  # fmt: skip
            choices[name] = tuple(values)
        space = cls(base, global_batch, cores, choices)
        for name, value in space.base_params.items():  # the base is always a point of it
            if value not in choices[name]:
                choices[name] = (value, *choices[name])
        return space

    @property
    def base_params(self) -> dict[str, Any]:
        base = self.base
        params = {
            "precision": base.precision, "micro_batch": base.micro_batch,
            "checkpointing": base.checkpointing.policy, "compile": base.compile or "off",
            "parallel": f"{base.parallel.strategy}-{base.parallel.ranks}",
            "threads": base.threads(self.cores), "workers": base.loader.workers,
        }  # fmt: skip
        if base.loader.workers:
            params["prefetch"] = base.loader.prefetch_factor or 2  # PyTorch's default
        return params

    def lean_params(self) -> dict[str, Any]:
        """The base at its leanest: smallest micro-batch, every block recomputed, one process
        (what is tried next when the base does not fit)."""
        lean = {**self.base_params, "micro_batch": min(self.choices["micro_batch"])}
        for name, value in (("checkpointing", "full"), ("parallel", "single-1"), ("workers", 0)):
            if value in self.choices[name]:
                lean[name] = value
        if not lean["workers"]:
            lean.pop("prefetch", None)
        return lean

    def suggest(self, trial: Any) -> dict[str, Any]:
        params = {name: trial.suggest_categorical(name, values)
                  for name, values in self.choices.items() if name != "prefetch"}  # fmt: skip
        if params["workers"]:  # prefetching is a worker's
            params["prefetch"] = trial.suggest_categorical("prefetch", self.choices["prefetch"])
        return params

    def project(self, params: dict[str, Any]) -> dict[str, Any]:
        """The params this space can take (a warm start from another model's study)."""
        return {k: v for k, v in params.items() if v in self.choices.get(k, ())}

    def config(self, params: dict[str, Any]) -> TrainConfig:
        """The TrainConfig of `params` at the global batch; the base itself for its own."""
        if params == self.base_params:
            return self.base
        strategy, _, ranks_text = params["parallel"].rpartition("-")
        ranks = int(ranks_text)
        replicas = 1 if strategy == "pipeline" else ranks
        if self.global_batch % replicas:
            raise KilnError(f"global batch {self.global_batch} does not split over {ranks} ranks.")
        per_rank = self.global_batch // replicas
        micro = max(d for d in range(1, params["micro_batch"] + 1) if per_rank % d == 0)
        workers = params["workers"]
        return self.base.replace(
            precision=params["precision"], micro_batch=micro, accumulation=per_rank // micro,
            checkpointing={"policy": params["checkpointing"]},
            compile=None if params["compile"] == "off" else params["compile"],
            parallel={"strategy": strategy, "ranks": ranks,
                      "threads_per_rank": min(params["threads"], max(1, self.cores // ranks))},
            loader={"workers": workers, "prefetch_factor": params.get("prefetch") if workers
                    else None,
                    "persistent_workers": self.base.loader.persistent_workers and workers > 0},
        )  # fmt: skip

    def key(self, config: TrainConfig) -> str:
        """The same for two configs that train alike (threads None and the count it means)."""
        data = config.to_json()
        data["parallel"]["threads_per_rank"] = config.threads(self.cores)
        return json.dumps(data, sort_keys=True)


def describe(config: TrainConfig) -> str:
    """A config in a few words, for progress lines and tables."""
    p = config.parallel
    words = [config.precision, f"micro {config.micro_batch}×{config.accumulation}",
             f"ckpt {config.checkpointing.policy}", f"compile {config.compile or 'off'}",
             f"{p.strategy}×{p.ranks}, {p.threads_per_rank or 'auto'} thr",
             f"workers {config.loader.workers}"]  # fmt: skip
    return ", ".join(words)


# ------------------------------------------------------------------------------ memory model


def group_of(config: TrainConfig) -> tuple[str, str, int]:
    """What shifts the peak besides the micro-batch: precision, checkpointing, ranks (each
    rank a process with its own copy of the runtime)."""
    return (config.precision, config.checkpointing.policy, config.parallel.ranks)


Point = tuple[Any, int, float]  # (group_of(config), micro_batch, measured peak MiB)


def predict_peak(points: list[Point], group: Any, micro_batch: int) -> float | None:
    """The peak (MiB) `points` — (group, micro_batch, measured peak) of trials so far — predict
    for `micro_batch` in `group`: a least-squares a + b·micro_batch (b ≥ 0: more samples never
    need less memory) where two micro-batches were measured, and never below a measured peak
    of a smaller or equal micro-batch. None where the group has no point."""
    mine = [(m, peak) for g, m, peak in points if g == group]
    if not mine:
        return None
    floor = max((peak for m, peak in mine if m <= micro_batch), default=0.0)
    xs = [m for m, _ in mine]
    if len(set(xs)) < 2:
        return floor or None
    mean_x, mean_y = statistics.mean(xs), statistics.mean(p for _, p in mine)
    slope = sum((m - mean_x) * (p - mean_y) for m, p in mine) / sum((m - mean_x) ** 2 for m in xs)
    slope = max(0.0, slope)
    return max(floor, mean_y + slope * (micro_batch - mean_x))


def predicted_over(points: list[Point], config: TrainConfig, cap_mib: float | None) -> str | None:
    """Why `config` is not worth a run under `cap_mib` (None: run it): predicted above
    PREDICT_MARGIN × the cap by the trials measured so far."""
    if cap_mib is None:
        return None
    predicted = predict_peak(points, group_of(config), config.micro_batch)
    if predicted is None or predicted <= PREDICT_MARGIN * cap_mib:
        return None
    return (f"skipped: predicted to peak at {over_limit(predicted, PREDICT_MARGIN * cap_mib)} "
            f"({PREDICT_MARGIN:g} × the limit) from the trials measured so far")  # fmt: skip


# ------------------------------------------------------------------------------ one child run


@dataclass
class Run:
    """One child run: how it ended, the tree's peak as the watchdog saw it, its line."""

    state: str  # "ok" | "over-memory" | "out-of-time" | "failed"
    reason: str | None
    peak_mib: float
    wall_s: float
    result: dict[str, Any] | None = None


@dataclass
class Probe:
    """What every child run of one tuning shares: the job's functions, steps and limits."""

    refs: dict[str, dict[str, str] | None]
    steps: int
    folder: Path
    cap_mib: float | None

    def run(self, config: TrainConfig, deadline: float | None) -> Run:
        stem = self.folder / f"job-{uuid.uuid4().hex[:8]}"
        job = {**self.refs, "config": config.to_json(), "steps": self.steps,
               "warmup": WARMUP_STEPS}  # fmt: skip
        Path(f"{stem}.json").write_text(json.dumps(job))
        with open(f"{stem}.out", "w") as out, open(f"{stem}.err", "w") as err:
            started = time.monotonic()
            # Its own session: the watchdog kills the child's whole process group, never ours.
            proc = subprocess.Popen(
                [sys.executable, "-m", "kiln.train.trial", f"{stem}.json"], stdout=out,
                stderr=err, env=_child_env(), start_new_session=True,
            )  # fmt: skip
            try:
                peak, why = watch(proc, self.cap_mib, deadline)
            except BaseException:  # Ctrl-C, SIGTERM, a bug: its own session hears no signal
                kill_tree(proc)
                raise
        wall = time.monotonic() - started
        if why is not None:
            state = "over-memory" if why.startswith("over") else "out-of-time"
            return Run(state, why, peak, wall)
        return _read(stem, proc.returncode, peak, wall)


def _read(stem: Path, returncode: int, peak: float, wall: float) -> Run:
    lines = Path(f"{stem}.out").read_text().splitlines()
    found = [line[len(MARK) :] for line in lines if line.startswith(MARK)]
    if found:
        result = json.loads(found[-1])
        if result.get("ok"):
            return Run("ok", None, peak, wall, result)
        return Run("failed", result.get("error"), peak, wall)
    errors = [line.strip() for line in Path(f"{stem}.err").read_text().splitlines()
              if line.strip()]  # fmt: skip
    last = errors[-1] if errors else "no output"
    return Run("failed", f"the trial process ended with code {returncode}: {last}", peak, wall)


def _child_env() -> dict[str, str]:
    """The child imports what this process can: the user's modules beside them, a test's
    helpers."""
    paths = [os.path.abspath(p or os.getcwd()) for p in sys.path]
    paths = [p for p in dict.fromkeys(paths) if os.path.isdir(p)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def watch(proc: subprocess.Popen, cap_mib: float | None,
          deadline: float | None) -> tuple[float, str | None]:  # fmt: skip
    """Poll `proc`'s tree every POLL_S (POLL_UNCAPPED_S without a cap) until it ends; kill
    the tree past `cap_mib` or `deadline` (time.monotonic()). The tree's peak (MiB) and why
    it was killed (None: not)."""
    import psutil

    try:
        root = psutil.Process(proc.pid)
    except psutil.Error:  # it has already ended
        proc.wait()
        return 0.0, None
    peak = 0.0
    while proc.poll() is None:
        mib = tree_mib(root)
        peak = max(peak, mib)
        why = None
        if cap_mib is not None and mib > cap_mib:
            why = f"over the memory limit: {over_limit(mib, cap_mib)}"
        elif deadline is not None and time.monotonic() > deadline:
            why = "out of time: stopped where the time left for it ended"
        if why is not None:
            kill_tree(proc)
            return peak, why
        time.sleep(POLL_S if cap_mib is not None else POLL_UNCAPPED_S)
    return peak, None


def tree_mib(root: Any) -> float:
    """The memory of `root`'s tree: root's resident high-water mark (VmHWM: no spike between
    two polls is missed) plus each descendant's unique set (USS: a forked loader worker
    shares its parent's pages, which its RSS would count again)."""
    import psutil

    total = _hwm_mib(root)
    with contextlib.suppress(psutil.Error):
        for child in root.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                total += child.memory_full_info().uss / MIB
    return total


def _hwm_mib(process: Any) -> float:
    import psutil

    try:
        with open(f"/proc/{process.pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
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


# ------------------------------------------------------------------------------ figures


def tail_loss(losses: list[float]) -> float | None:
    """The mean training loss over the last third of the steps (finite ones)."""
    tail = [v for v in losses[-max(1, len(losses) // 3) :] if math.isfinite(v)]
    return statistics.mean(tail) if tail else None


def figures(run: Run, target_loss: float | None) -> dict[str, Any]:
    """A measured run as the study keeps it. Its peak is the larger of the watchdog's and the
    ranks' own high-water marks (a spike after the last poll)."""
    result = run.result or {}
    losses = result["loss"]
    ranks = result["peak_mib"]
    step_s = statistics.median(result["step_s"]) if result["step_s"] else math.nan
    reached = None
    if target_loss is not None:
        reached = next((i + 1 for i, v in enumerate(losses) if v <= target_loss), None)
    return {
        "samples_per_s": result["samples_per_s"],
        "peak_mib": max(run.peak_mib, *ranks.values()),
        "rank_peak_mib": ranks,
        "train_peak_mib": result["train_peak_mib"],
        "loss": tail_loss(losses),
        "loss_curve": losses,
        "step_s": result["step_s"],
        # steps to the target × the steady step: compilation is not charged to a long run
        "time_to_loss": reached * step_s if reached else None,
        "wall_s": run.wall_s,
    }


# ------------------------------------------------------------------------------ the search


@dataclass
class Search:
    """One study's trials: what was measured, the loss reference, the memory model."""

    study: Any
    space: Space
    probe: Probe
    target_loss: float | None
    say: Say
    queue: list[dict[str, Any]] = field(default_factory=list)  # params to try first
    seen: dict[str, int] = field(default_factory=dict)  # config key → trial number
    points: list[Point] = field(default_factory=list)
    reference: dict[str, Any] | None = None  # {"trial", "loss"}: what trials must match
    ran: int = 0  # trials run (in this study, this call or before)
    base_wall_s: float | None = None

    def load(self) -> None:
        """A resumed study: what its trials measured counts."""
        for trial in self.study.trials:
            attrs = trial.user_attrs
            if "key" not in attrs or "duplicate_of" in attrs or trial.state.name == "FAIL":
                continue
            self.seen.setdefault(attrs["key"], trial.number)
            if attrs.get("point"):
                group, micro, peak = attrs["point"]
                self.points.append((tuple(group), micro, peak))
            if attrs.get("ran"):
                self.ran += 1
            if attrs.get("reference") and self.reference is None:
                self.reference = {"trial": trial.number, "loss": attrs["measure"]["loss"]}

    def run(self, trials: int, until: Callable[[], float | None]) -> None:
        idle = 0
        while self.ran < trials and idle < IDLE_ASKS and _left(until()) > 0:
            idle = 0 if self.step(until(), trials) else idle + 1

    def step(self, deadline: float | None, trials: int) -> bool:
        """One suggestion; whether a child ran for it."""
        if self.queue:
            self.study.enqueue_trial(self.queue.pop(0))
        with warnings.catch_warnings():  # Optuna's note that heartbeats need optimize():
            warnings.filterwarnings("ignore", "Heartbeat", UserWarning)  # one worker, no need
            trial = self.study.ask()
        params = self.space.suggest(trial)
        try:
            config = self.space.config(params)
        except KilnError as exc:
            return self._prune(trial, f"not a valid config: {exc}")
        key = self.space.key(config)
        trial.set_user_attr("key", key)
        if key in self.seen:
            return self._duplicate(trial, self.seen[key])
        skip = self._predicted_over(config)
        if skip:
            return self._prune(trial, skip)
        self.seen[key] = trial.number
        self.say(f"trial {self.ran + 1}/{trials}: {describe(config)}")
        try:
            run = self.probe.run(config, self.trial_deadline(deadline))
        except BaseException:  # stopped mid-trial (Ctrl-C): a resumed study measures it again
            self._fail(trial)
            raise
        self.ran += 1
        trial.set_user_attr("ran", True)
        if params == self.space.base_params:
            self.base_wall_s = run.wall_s
        self._judge(trial, params, config, run)
        return True

    def trial_deadline(self, deadline: float | None) -> float | None:
        """When a run must end: the user's --time, else a generous multiple of the base's."""
        if deadline is not None or self.base_wall_s is None:
            return deadline  # the base itself: as long as the user's own training takes
        return time.monotonic() + max(TRIAL_FLOOR_S, 10 * self.base_wall_s)

    def _judge(self, trial: Any, params: dict[str, Any], config: TrainConfig, run: Run) -> None:
        if run.state != "ok":
            self._stopped(trial, params, config, run)
            return
        measure = figures(run, self.target_loss)
        trial.set_user_attr("measure", measure)
        self._point(trial, config, measure["peak_mib"])
        if self.reference is None and measure["peak_mib"] <= (self.probe.cap_mib or math.inf):
            # the base; or, when it did not fit, the first run that did (its lean variant)
            self.reference = {"trial": trial.number, "loss": measure["loss"]}
            trial.set_user_attr("reference", True)
        why = self._rejected(measure)
        if why:
            self._prune(trial, why)
            return
        value = measure["samples_per_s"] if self.target_loss is None else measure["time_to_loss"]
        self.study.tell(trial, value)
        self.say(f"  {measure['samples_per_s']:.1f} samples/s, peak "
                 f"{measure['peak_mib']:.0f} MiB, loss {measure['loss']:.4f}")  # fmt: skip

    def _stopped(self, trial: Any, params: dict[str, Any], config: TrainConfig, run: Run) -> None:
        """A run that did not finish: over memory (then, for the base, its lean variant is
        tried next), out of time, or failed."""
        if run.state == "over-memory":
            self._point(trial, config, run.peak_mib)  # a lower bound: it was stopped
            if params == self.space.base_params and self.reference is None:
                self.queue.insert(0, self.space.lean_params())
        trial.set_user_attr("measure", {"peak_mib": run.peak_mib, "wall_s": run.wall_s})
        self._prune(trial, run.reason or run.state)

    def _rejected(self, measure: dict[str, Any]) -> str | None:
        """Why a measured run does not count (None: it does)."""
        cap = self.probe.cap_mib
        if cap is not None and measure["peak_mib"] > cap:
            return (f"over the memory limit: peaked at {over_limit(measure['peak_mib'], cap)} "
                    "between two polls")  # fmt: skip
        worse = self._worse(measure["loss"])
        if worse:
            return worse
        if self.target_loss is not None and measure["time_to_loss"] is None:
            return (f"the loss did not reach {self.target_loss:g} in {self.probe.steps} steps "
                    f"(last {measure['loss_curve'][-1]:.4f})")  # fmt: skip
        return None

    def _worse(self, loss: float | None) -> str | None:
        """Why a trial's late loss fails the base's (None: it trains as well)."""
        assert self.reference is not None
        ref = self.reference["loss"]
        if loss is None or ref is None:
            return "its loss is not finite" if loss is None else None
        if loss > ref * (1 + LOSS_TOLERANCE):
            return (f"trains worse: its mean loss over the last third of the steps is "
                    f"{loss:.4f}, the base's {ref:.4f} (more than {LOSS_TOLERANCE:.0%} "
                    "above)")  # fmt: skip
        return None

    def _predicted_over(self, config: TrainConfig) -> str | None:
        return predicted_over(self.points, config, self.probe.cap_mib)

    def _point(self, trial: Any, config: TrainConfig, peak: float) -> None:
        point = (group_of(config), config.micro_batch, peak)
        self.points.append(point)
        trial.set_user_attr("point", point)

    def _duplicate(self, trial: Any, number: int) -> bool:
        import optuna

        same = self.study.trials[number]
        trial.set_user_attr("duplicate_of", number)
        for key in ("measure", "reason"):
            if key in same.user_attrs:
                trial.set_user_attr(key, same.user_attrs[key])
        if same.state == optuna.trial.TrialState.COMPLETE:
            self.study.tell(trial, same.value)
        else:
            self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        return False

    def _fail(self, trial: Any) -> None:
        import optuna

        with contextlib.suppress(Exception):  # the stop that got here is what the user hears
            self.study.tell(trial, state=optuna.trial.TrialState.FAIL)

    def _prune(self, trial: Any, reason: str) -> bool:
        import optuna

        trial.set_user_attr("reason", reason)
        self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        self.say(f"  pruned: {reason}")
        return False


def _left(deadline: float | None) -> float:
    return math.inf if deadline is None else deadline - time.monotonic()


# ------------------------------------------------------------------------------ the pick


def best_trial(study: Any, minimize: bool) -> Any | None:
    """The best complete trial (the earliest of equals); None when none completed."""
    import optuna

    done = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
            if "duplicate_of" not in t.user_attrs]  # fmt: skip
    if not done:
        return None
    sign = 1 if minimize else -1
    return min(done, key=lambda t: (sign * t.value, t.number))


def confirm(probe: Probe, pick: TrainConfig, base: TrainConfig, rounds: int,
            deadline: Callable[[], float | None],
            target_loss: float | None) -> dict[str, Any]:  # fmt: skip
    """The pick against the base in alternating child runs, `rounds` each: the speedup
    (base / pick of the median steady step, or of the time to the target loss) with the
    interval kiln tune confirms with; "better" only when its low end is above 1. "runs":
    each side's per-round figures and the order the runs went in."""
    from kiln.tune.measure import speedup_interval

    sides: dict[str, Any] = {"base": [], "pick": [], "order": []}
    for i in range(rounds):
        order = ("base", "pick") if i % 2 == 0 else ("pick", "base")
        for name in order:
            sides["order"].append(name)
            run = probe.run(pick if name == "pick" else base, deadline())
            if run.state != "ok":
                return _stopped(f"the {name} run ended {run.reason}", sides)
            measure = figures(run, target_loss)
            if target_loss is None:
                sides[name].append(measure["step_s"])
            elif measure["time_to_loss"] is not None:
                sides[name].append([measure["time_to_loss"]])
            else:
                return _stopped(f"the {name} run did not reach {target_loss:g}", sides)
    speed = speedup_interval(sides["base"], sides["pick"])
    # kiln.tune.confirm's verdict: "better" only beyond the interval
    verdict = "better" if speed.low > 1 else "worse" if speed.high < 1 else "no better"
    return {"verdict": verdict, "speedup": speed.to_json(), "adopt": verdict == "better",
            "runs": sides}  # fmt: skip


def _stopped(why: str, sides: dict[str, Any]) -> dict[str, Any]:
    """A confirmation that could not finish: the base is kept."""
    return {"verdict": f"the confirmation stopped: {why}", "speedup": None, "adopt": False,
            "runs": sides}  # fmt: skip


# ------------------------------------------------------------------------------ the API


@dataclass
class Job:
    """One call of `tune`, settled: what it searches, where it keeps it, how long it has."""

    specs: dict[str, str | None]  # model, data, loss, optimizer as names (for the record)
    space: Space
    probe: Probe
    study: str
    url: str
    target_loss: float | None
    trials: int
    seconds: float | None
    deadline: float | None  # time.monotonic() by which the whole call ends
    signature: dict[str, Any]
    confirm_rounds: int
    seed: int | None
    warm_start: bool

    @property
    def objective(self) -> str:
        return "samples_per_s" if self.target_loss is None else f"time_to_loss{self.target_loss:g}"

    def keep_s(self, base_wall_s: float | None) -> float:
        """The confirmation's share of `seconds`: ≥ 2 runs a side at the base's pace."""
        if not self.seconds:
            return 0.0
        need = 2 * self.confirm_rounds * (base_wall_s or 0.0)
        return min(0.5 * self.seconds, max(CONFIRM_SHARE * self.seconds, need))


def tune(
    model: Any,
    data: Any,
    *,
    base: TrainConfig,
    global_batch: int,
    seconds: float | None = None,
    trials: int = TRIALS,
    loss: Any = None,
    optimizer: Any = None,
    max_memory_mib: float | None = None,
    target_loss: float | None = None,
    storage: str | None = None,
    study: str | None = None,
    probe_steps: int = PROBE_STEPS,
    progress: Say | None = None,
    output: str | os.PathLike | None = None,
    space: dict[str, list[Any]] | None = None,
    confirm_rounds: int = CONFIRM_ROUNDS,
    seed: int | None = None,
    warm_start: bool = True,
) -> dict[str, Any]:
    """Search TrainConfigs at `global_batch` (see the module docstring); the result:
    {"config": the pick, "base", "adopted", "verdict", "speedup": {"value", "low", "high"} or
    None, "trials": [{trial, params, config, samples_per_s, peak_mib, loss, state, reason}],
    "tolerance", "reference", "study", "storage", "warm_start", "library_id"}.

    `model`, `data`, `loss`, `optimizer` are `module:function` names or objects (functions
    by their importable name; anything else pickled to the trial processes). `space` narrows
    knobs to given values (the base's own always stays). With `output` the result is written
    there: `kiln.train.read_config(output)` reads the pick back."""
    from kiln.hardware import cpu_info
    from kiln.tune.storage import default_url

    _check(global_batch, seconds, trials, probe_steps, max_memory_mib, confirm_rounds, output)
    deadline = time.monotonic() + seconds if seconds else None
    base = at_batch(base, global_batch)
    given = {"model": model, "data": data, "loss": loss, "optimizer": optimizer}
    specs = {name: _spec(value) for name, value in given.items()}
    with tempfile.TemporaryDirectory(prefix="kiln-train-tune-") as folder:
        refs = {name: _ref(value, name, Path(folder)) for name, value in given.items()}
        facts = inspect_model(model, base.seed)
        cpu = cpu_info()
        searched = Space.build(base, global_batch, cpu.logical_cores, cpu.features,
                               facts["blocks"], space)  # fmt: skip
        job = Job(specs, searched, Probe(refs, probe_steps, Path(folder), max_memory_mib), "",
                  storage or default_url(), target_loss, trials, seconds, deadline,
                  facts["signature"], confirm_rounds, seed, warm_start)  # fmt: skip
        rest = {"base": base.to_json(), "steps": probe_steps, "space": searched.choices}
        job.study = study or study_name(specs, global_batch, job.objective, max_memory_mib, rest)
        result = run_job(job, progress or (lambda _m: None))
    if output is not None:
        from kiln.home import atomic_write_json

        atomic_write_json(Path(output), result)
    return result


def run_job(job: Job, say: Say) -> dict[str, Any]:
    """The trials, the pick, its confirmation, the library record: the result."""
    from kiln.tune.library import Library
    from kiln.tune.storage import _safe

    minimize = job.target_loss is not None
    search = Search(_study(job.url, job.study, minimize, job.trials, job.seed), job.space,
                    job.probe, job.target_loss, say)  # fmt: skip
    search.load()
    library = Library(job.url)
    warm = _warm_queue(search, library, job.signature, job.objective, job.warm_start)

    def until() -> float | None:
        return None if job.deadline is None else job.deadline - job.keep_s(search.base_wall_s)

    search.run(job.trials, until)
    pick = best_trial(search.study, minimize)
    if pick is None:
        raise KilnError(_nothing_fit(search, job.study))
    chosen = job.space.config(dict(pick.params))
    gains = _confirmation(search, chosen, job.deadline, job.confirm_rounds)
    config = chosen if gains["adopt"] else job.space.base
    params = pick.params if gains["adopt"] else job.space.base_params
    library_id = _remember(library, job, params, config, gains, len(search.study.trials))
    return {
        "config": config.to_json(), "base": job.space.base.to_json(), "adopted": gains["adopt"],
        "verdict": gains["verdict"], "speedup": gains["speedup"],
        "confirmation": gains.get("runs"), "objective": job.objective,
        "global_batch": job.space.global_batch, "max_memory_mib": job.probe.cap_mib,
        "target_loss": job.target_loss, "probe_steps": job.probe.steps,
        "tolerance": LOSS_TOLERANCE, "reference": search.reference,
        "trials": [_row(t) for t in search.study.trials], "study": job.study,
        "storage": _safe(job.url), "warm_start": warm, "library_id": library_id,
        "model": job.specs["model"], "data": job.specs["data"],
    }  # fmt: skip


def _confirmation(search: Search, chosen: TrainConfig, deadline: float | None,
                  rounds: int) -> dict[str, Any]:  # fmt: skip
    space = search.space
    if space.key(chosen) == space.key(space.base):
        return {"verdict": BASE_BEST, "speedup": {"value": 1.0, "low": 1.0, "high": 1.0},
                "adopt": False}  # fmt: skip
    base_trial = _base_trial(search)
    if base_trial is None or base_trial.state.name != "COMPLETE":
        # Nothing to race: the base did not qualify (over the limit, failing, short of the
        # target loss); the pick did.
        why = base_trial.user_attrs.get("reason") if base_trial is not None else "not run"
        return {"verdict": f"the base did not qualify: {why}", "speedup": None, "adopt": True}
    search.say(f"confirming against the base: {rounds} runs each, alternating")
    return confirm(search.probe, chosen, space.base, rounds,
                   lambda: search.trial_deadline(deadline), search.target_loss)  # fmt: skip


def _base_trial(search: Search) -> Any | None:
    key = search.space.key(search.space.base)
    for trial in search.study.trials:
        attrs = trial.user_attrs
        if attrs.get("key") == key and attrs.get("ran") and "duplicate_of" not in attrs:
            return trial
    return None


def _row(trial: Any) -> dict[str, Any]:
    """One trial as the result lists it."""
    attrs = trial.user_attrs
    measure = attrs.get("measure") or {}
    return {
        "trial": trial.number, "state": trial.state.name, "params": trial.params,
        "samples_per_s": measure.get("samples_per_s"), "peak_mib": measure.get("peak_mib"),
        "train_peak_mib": measure.get("train_peak_mib"), "loss": measure.get("loss"),
        "time_to_loss": measure.get("time_to_loss"), "reason": attrs.get("reason"),
        "duplicate_of": attrs.get("duplicate_of"), "ran": bool(attrs.get("ran")),
        "config": json.loads(attrs["key"]) if "key" in attrs else None,
    }  # fmt: skip


def _nothing_fit(search: Search, name: str) -> str:
    rows = [_row(t) for t in search.study.trials if t.user_attrs.get("ran")]
    return nothing_fit(rows, search.probe.cap_mib, name)


def nothing_fit(rows: list[dict[str, Any]], cap_mib: float | None, name: str) -> str:
    """Why no trial of study `name` qualified, from the trials that ran: what stopped them,
    counted (the memory cap, the time, a failure), and what to change."""
    if not rows:
        return (f"study '{name}': no trial ran within --time; give more --time (the study is "
                "kept and resumes).")  # fmt: skip
    over = [r for r in rows if (r["reason"] or "").startswith("over the memory")]
    late = [r for r in rows if (r["reason"] or "").startswith("out of time")]
    if len(late) == len(rows):
        return (f"no trial of study '{name}' finished within --time; give more --time or "
                "fewer --steps (the study is kept and resumes).")  # fmt: skip
    if over and cap_mib is not None and len(over) + len(late) == len(rows):
        least = min(r["peak_mib"] or math.inf for r in over)
        peak, cap = over_limit(least, cap_mib).split(" > ")
        causes = f"{len(over)} were stopped over it (the leanest at {peak})"
        fixes = "raise --max-memory or lower --batch"
        if late:
            causes += f", {len(late)} ran out of time"
            fixes = "raise --max-memory, lower --batch or give more --time"
        return (f"no configuration fit --max-memory {cap} in {len(rows)} trials of study "
                f"'{name}': {causes}; {fixes} (the study is kept and resumes).")  # fmt: skip
    return (f"no configuration trained in {len(rows)} trials of study '{name}' (first: "
            f"{rows[0]['reason']}); fix that, or run more --trials.")  # fmt: skip


def over_limit(peak_mib: float, cap_mib: float) -> str:
    """`PEAK MiB > CAP MiB`, both at the fewest decimals that show the peak above the cap
    (415.04 over 415 is "415.04 MiB > 415.00 MiB", never "415.0 MiB > 415 MiB")."""
    for decimals in range(4):
        peak, cap = f"{peak_mib:.{decimals}f}", f"{cap_mib:.{decimals}f}"
        if float(peak) > float(cap):
            return f"{peak} MiB > {cap} MiB"
    return f"{peak_mib:.6f} MiB > {cap_mib:.6f} MiB"


# ------------------------------------------------------------------------------ storage, library


def study_name(specs: dict[str, str | None], global_batch: int, objective: str,
               max_memory_mib: float | None, rest: dict[str, Any]) -> str:  # fmt: skip
    """`train-MODEL-DATA-bN-OBJECTIVE[-maxM MiB]-HARDWARE-DIGEST`: the limits are in the
    name, so a study measured under one limit never answers another; the digest covers the
    rest that changes a measure (the functions' full names, the base, the steps, the space)."""
    from kiln.tune.signature import hardware

    short = [(specs[k] or "").rpartition(":")[2].rpartition(".")[2] for k in ("model", "data")]
    limit = [f"max{max_memory_mib:g}MiB"] if max_memory_mib is not None else []
    digest = hashlib.sha256(json.dumps([specs, rest], sort_keys=True, default=str).encode())
    parts = ["train", *short, f"b{global_batch}", objective, *limit, hardware()["class"][:8],
             digest.hexdigest()[:8]]  # fmt: skip
    return "-".join(parts)


def _study(url: str, name: str, minimize: bool, trials: int, seed: int | None) -> Any:
    import optuna

    from kiln.tune.storage import optuna_storage

    storage = optuna_storage(url)  # first: it quiets Optuna's experimental-feature warnings
    sampler = optuna.samplers.TPESampler(
        seed=seed, n_startup_trials=min(8, max(2, trials // 4)), multivariate=True, group=True,
    )  # fmt: skip
    direction = "minimize" if minimize else "maximize"
    study = optuna.create_study(study_name=name, storage=storage, sampler=sampler,
                                direction=direction, load_if_exists=True)  # fmt: skip
    if study.direction.name.lower() != direction:
        raise KilnError(f"study '{name}' exists with another objective; choose another --study.")
    return study


def training_class() -> dict[str, Any]:
    """This machine as the library keys training records: its own class, so that inference
    studies (keyed by the plain hardware class) never warm-start from them."""
    from kiln.tune.signature import hardware

    machine = hardware()
    return {**machine, "class": f"train:{machine['class']}"}


def _warm_queue(search: Search, library: Any, signature: dict[str, Any], objective: str,
                warm_start: bool) -> list[str]:  # fmt: skip
    """Queue the base, then (`warm_start`) the winners of the nearest models on this
    training class; who they were."""
    base = search.space.base_params
    if search.space.key(search.space.base) not in search.seen:
        search.queue.append(base)
    if not warm_start:
        return []
    warm = []
    for distance, record in library.nearest(signature, training_class()["class"],
                                            f"train-{objective}"):  # fmt: skip
        params = {**base, **search.space.project(record.params)}
        if params != base:
            search.queue.append(params)
            warm.append(f"{record.model} (distance {distance:.2f})")
    if warm:
        search.say(f"warm start from the winners of {', '.join(warm)}")
    search.queue.extend(seeds(search.space))
    return warm


def seeds(space: Space) -> list[dict[str, Any]]:
    """The base with the changes that pay most often, one at a time and together: bf16 where
    the CPU has its kernels, torch.compile, data-parallel ranks of one thread each. Measured
    before the sampler's guesses, so a short study never misses them (as `kiln tune` starts
    from the engines' defaults)."""
    base, choices = space.base_params, space.choices
    changes: list[dict[str, Any]] = []
    bf16 = "bf16" in choices["precision"] and base["precision"] != "bf16"
    compiled = "default" in choices["compile"] and base["compile"] == "off"
    if bf16:
        changes.append({"precision": "bf16"})
    if compiled:
        changes.append({"compile": "default"})
    if bf16 and compiled:
        changes.append({"precision": "bf16", "compile": "default"})
    if "ddp-2" in choices["parallel"] and base["parallel"] == "single-1":
        changes.append({"parallel": "ddp-2", "threads": 1, **({"precision": "bf16"} if bf16
                                                               else {})})  # fmt: skip
    return [{**base, **change} for change in changes]


def _remember(library: Any, job: Job, params: dict[str, Any], config: TrainConfig,
              gains: dict[str, Any], count: int) -> int:  # fmt: skip
    """The study's outcome in the strategy library, under the training hardware class."""
    from kiln.tune.library import Record

    kept = {"verdict": gains["verdict"]}
    if gains.get("speedup"):
        kept["speedup"] = gains["speedup"]
    record = Record(kind="study", hardware=training_class(), model=job.specs["model"] or "",
                    signature=job.signature, objective=f"train-{job.objective}", params=params,
                    config=config.to_json(), gains=kept, pareto=[],
                    evidence={"study": job.study, "trials": count, "data": job.specs["data"],
                              "global_batch": job.space.global_batch})  # fmt: skip
    return library.add(record)


# ------------------------------------------------------------------------------ inputs


def _check(global_batch: int, seconds: float | None, trials: int, probe_steps: int,
           max_memory_mib: float | None, confirm_rounds: int,
           output: str | os.PathLike | None) -> None:  # fmt: skip
    if global_batch < 1:
        raise KilnError(f"--batch {global_batch}: give the global batch, 1 or more.")
    if trials < 1:
        raise KilnError(f"--trials {trials}: give 1 or more.")
    if probe_steps < WARMUP_STEPS + 2:
        raise KilnError(f"--steps {probe_steps}: a trial needs at least {WARMUP_STEPS + 2} "
                        f"(the first {WARMUP_STEPS} are warm-up).")  # fmt: skip
    if seconds is not None and seconds <= 0:
        raise KilnError(f"--time {seconds:g}s: give a positive duration, e.g. --time 15m.")
    if max_memory_mib is not None and max_memory_mib <= 0:
        raise KilnError(f"--max-memory {max_memory_mib:g} MiB: give a positive size, e.g. 2GB.")
    if confirm_rounds < 2:
        raise KilnError(f"confirm_rounds {confirm_rounds}: the confirmation needs 2 or more.")
    if output is not None:
        from kiln.home import output_problem

        problem = output_problem(Path(output))
        if problem:
            raise KilnError(f"-o {output}: {problem}.")


def at_batch(base: TrainConfig, global_batch: int) -> TrainConfig:
    """The base with its micro_batch set so its global batch is `global_batch` (as kiln
    train --batch sets it)."""
    replicas = 1 if base.parallel.strategy == "pipeline" else base.parallel.ranks
    per_step = base.accumulation * replicas
    if global_batch % per_step:
        raise KilnError(f"--batch {global_batch} does not split into the base's accumulation "
                        f"{base.accumulation} × {replicas} rank(s): give a multiple of "
                        f"{per_step}.")  # fmt: skip
    return base.replace(micro_batch=global_batch // per_step)


def _spec(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    from kiln.compress.loading import spec_of

    return spec_of(value)


def _ref(value: Any, name: str, folder: Path) -> dict[str, str] | None:
    """How a trial process finds `value`: its importable `module:function`, else a pickle."""
    if value is None:
        return None
    from kiln.compress.loading import load_callable, spec_of

    if isinstance(value, str):
        load_callable(value, f"the {name}")  # a bad name is refused before any trial
        return {"spec": value}
    spec = spec_of(value)
    if _importable(spec, value):
        return {"spec": spec}
    if isinstance(value, types.FunctionType | types.MethodType):
        raise KilnError(f"the {name} {spec} cannot be imported by the trial processes: make it "
                        "a module-level function (module:function), not a lambda or a "
                        "function of __main__.")  # fmt: skip
    path = folder / f"{name}.pkl"
    try:
        with open(path, "wb") as file:
            pickle.dump(value, file)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise KilnError(f"the {name} {spec} cannot reach the trial processes ({exc}); give a "
                        "module:function that builds it.") from None  # fmt: skip
    return {"pickle": str(path)}


def _importable(spec: str, value: Any) -> bool:
    module_name, _, qualname = spec.partition(":")
    if not qualname or module_name == "__main__" or "<" in qualname:
        return False
    try:
        found: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return False
    return found is value


def inspect_model(model: Any, seed: int) -> dict[str, Any]:
    """Built once here, seeded, then dropped: how many repeated blocks it has (what
    checkpointing can wrap) and its signature for the library."""
    from torch import nn

    from kiln.compress.loading import call, load_callable
    from kiln.train.memory import find_blocks
    from kiln.train.trial import Seeded

    if isinstance(model, str):
        model = load_callable(model, "model")
    module = model if isinstance(model, nn.Module) else call(
        Seeded(model, seed), "the model factory", nn.Module, "a torch.nn.Module")  # fmt: skip
    return {"blocks": len(find_blocks(module)), "signature": signature(module)}


def signature(module: Any) -> dict[str, Any]:
    """A torch model's signature as kiln.tune.signature.distance reads one: the mix of leaf
    module types, and 2 × the weights of its Linear (matmul) and Conv (conv) layers — their
    FLOPs per input position — and its parameters."""
    from torch import nn

    leaves = [m for m in module.modules() if not any(True for _ in m.children())]
    kinds = Counter(type(m).__name__ for m in leaves)
    total = sum(kinds.values()) or 1
    conv = sum(m.weight.numel() for m in leaves if isinstance(m, nn.modules.conv._ConvNd))
    matmul = sum(m.weight.numel() for m in leaves if isinstance(m, nn.Linear))
    return {
        "ops": {k: v / total for k, v in sorted(kinds.items())}, "nodes": total,
        "flops": {"conv": 2 * conv, "matmul": 2 * matmul},
        "parameters": sum(p.numel() for p in module.parameters()), "dynamic_dims": [],
    }  # fmt: skip


__all__ = ["LOSS_TOLERANCE", "Space", "predict_peak", "predicted_over", "study_name", "tune"]
