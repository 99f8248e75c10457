"""The search space: every decision of a `CompileConfig` (engine, precision, calibration,
passes, the engine's runtime options) and, for throughput, the batch and concurrency a server
would run — or, served to clients, the dynamic batcher's max batch and max delay, and with
recorded traffic the bucket set (sizes per dim proposed from the traffic's shapes) — as Optuna
parameters, suggested define-by-run.

Parameter names carry their engine (`ort.threads`, `openvino.streams`): a parameter keeps one
set of choices across trials, which Optuna's samplers require. Where an engine and precision
have a hand recipe (kiln.precision.recipes), `ENGINE.PRECISION.recipe` chooses between Kiln's
own compile ("kiln") and the recipe ("hand"); the recipes are the study's first trials.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import onnx_ir as ir

from kiln.backends.ort import ARENA_EXTEND
from kiln.config import CALIBRATION_METHODS, CompileConfig
from kiln.passes import default_pipeline
from kiln.precision import ENGINES_FOR, hand_recipe, has_hand_recipe, is_static
from kiln.tune.serving import DELAYS_MS
from kiln.tune.traffic import PER_DIM

# Passes toggled together: one switch per kind of rewrite, not one per rule (27 switches would
# spend the trials on combinations that make no difference). "attention" off leaves every
# attention block as exported, so a trial times the fused ops against the blocks themselves.
PASS_GROUPS = {
    "attention": (
        "canonical-mask", "detach-shape-reads", "drop-noop-reshapes", "fuse-causal-attention",
        "fuse-attention", "fuse-sdpa", "fuse-mha", "fuse-padding-mask", "fuse-masked-attention",
        "fuse-mha-bias", "fuse-packed-attention", "sdpa-to-mha", "flash-attention",
    ),
    "elementwise": (
        "fold-batchnorm", "fuse-conv-activation", "fuse-layernorm", "fuse-gelu",
        "fuse-skip-layernorm", "fuse-bias-gelu",
    ),
    "gemm": ("fuse-gemm", "fuse-matmul"),
    "prune-rows": ("prune-rows",),
}  # fmt: skip
BATCHES = (1, 2, 4, 8, 16, 32)
STATIC = [False, True]  # openvino.static, latency only: throughput runs at the batch it picks


@dataclass(frozen=True)
class Choice:
    """One trial's decisions: the config that builds the artifact, and how it is driven."""

    config: CompileConfig
    batch: int = 1  # served: the batcher's max batch
    concurrency: int = 1
    runtime: dict[str, Any] = field(default_factory=dict)  # engine options beyond compile's
    clients: int = 0  # > 0: throughput is served to this many clients through the batcher
    max_delay_ms: float = 0.0
    buckets_per_dim: int = 0  # served traffic: a bucket set of this many sizes per dim

    def serving(self) -> dict[str, Any] | None:
        """What `kiln serve` takes from this choice (None when not served)."""
        if not self.clients:
            return None
        return {"max_batch": self.batch, "max_delay_ms": self.max_delay_ms,
                "clients": self.clients}  # fmt: skip

    @property
    def compile_key(self) -> tuple:
        """What the passes and the precision stage depend on (runtime options do not)."""
        c = self.config
        return c.engine, c.precision, c.pipeline, c.calib_method, c.recipe


@dataclass(frozen=True)
class Space:
    """What may be searched for one model on this machine."""

    engines: tuple[str, ...]
    precisions: tuple[str, ...]
    cores: int
    throughput: bool = False  # search batch and concurrency too
    clients: int = 0  # > 0: served throughput; search the batcher's max batch and delay
    buckets: bool = False  # served recorded traffic of several shapes: search bucket sets
    # memory is an objective or a limit: search the engines' memory options too (the arena's
    # extend strategy, OpenVINO's weight mapping), which only memory can tell apart
    memory: bool = False

    @classmethod
    def for_model(
        cls, engines: list[str], precisions: list[str], throughput: bool = False, clients: int = 0,
        buckets: bool = False, memory: bool = False,
    ) -> Space:  # fmt: skip
        cores = os.cpu_count() or 1
        return cls(tuple(engines), tuple(precisions), cores, throughput, clients, buckets, memory)


def suggest(trial: Any, space: Space, model: ir.Model, base: CompileConfig) -> Choice:
    """The trial's choice; `base` holds what is not searched (budget, calibration data,
    inputs, shapes)."""
    engine = trial.suggest_categorical("engine", list(space.engines))
    here = [p for p in space.precisions if engine in ENGINES_FOR[p]]
    precision = trial.suggest_categorical(f"{engine}.precision", here)
    recipe = _recipe(trial, model, engine, precision)
    calib_method = base.calib_method
    if recipe is None and is_static(model, precision, engine) and engine == "ort":
        calib_method = trial.suggest_categorical("ort.calib_method", list(CALIBRATION_METHODS))
    options = _ort(trial, space) if engine == "ort" else _openvino(trial, space)
    config = base.replace(
        engine=engine,
        precision=precision,
        calib_method=calib_method,
        pipeline=() if recipe else _pipeline(trial, engine),  # a recipe: the original graph
        engine_options=options,
        recipe=recipe,
    )
    if space.throughput and space.clients:  # the batcher has one engine stream
        batch = trial.suggest_categorical("serve.max_batch", list(BATCHES))
        delay = trial.suggest_categorical("serve.max_delay_ms", list(DELAYS_MS))
        per_dim = 0
        if space.buckets:
            per_dim = trial.suggest_categorical("serve.buckets_per_dim", list(PER_DIM))
        return Choice(config, batch, 1, options, space.clients, delay, per_dim)
    if not space.throughput:  # OpenVINO compiled static at the dims the trial is timed at
        static = engine == "openvino" and trial.suggest_categorical("openvino.static", STATIC)
        return Choice(config.replace(static=static), runtime=options)
    batch = trial.suggest_categorical("batch", list(BATCHES))
    concurrency = trial.suggest_int("concurrency", 1, max(1, space.cores))
    return Choice(config, batch, concurrency, options)


def _recipe(trial: Any, model: ir.Model, engine: str, precision: str) -> str | None:
    """The hand recipe the trial runs, or None for Kiln's own compile."""
    if not has_hand_recipe(engine, precision):
        return None
    if trial.suggest_categorical(f"{engine}.{precision}.recipe", ["kiln", "hand"]) == "kiln":
        return None
    return hand_recipe(model, engine, precision)


def _pipeline(trial: Any, engine: str) -> tuple[str, ...]:
    names = [s.name for s in default_pipeline(engine=engine)]
    off: set[str] = set()
    for group, members in PASS_GROUPS.items():
        present = any(n in members for n in names)
        if present and not trial.suggest_categorical(f"{engine}.passes.{group}", [True, False]):
            off |= set(members)
    return tuple(n for n in names if n not in off)


def _ort(trial: Any, space: Space) -> dict[str, Any]:
    threads = trial.suggest_int("ort.threads", 1, space.cores)
    prepacking = trial.suggest_categorical("ort.prepacking", [True, False])
    # Steadiness (OrtOptions): denormals flushed; the pool pinned, which an explicit thread
    # count otherwise turns off; spinning stopped after each run (None: by the weights' size).
    denormals = trial.suggest_categorical("ort.denormal_as_zero", [False, True])
    pinned = threads > 1 and trial.suggest_categorical("ort.pinning", [False, True])
    stop = trial.suggest_categorical("ort.stop_spinning", [None, True, False])
    mode = trial.suggest_categorical("ort.execution_mode", ["sequential", "parallel"])
    # Parallel mode runs independent branches on the inter-op pool; sequential ignores it.
    inter = trial.suggest_int("ort.inter_threads", 1, space.cores) if mode == "parallel" else 0
    options = {
        "optimization": trial.suggest_categorical("ort.optimization", ["basic", "extended", "all"]),
        "intra_op_threads": threads,
        "inter_op_threads": inter,
        "execution_mode": mode,
        "spinning": trial.suggest_categorical("ort.spinning", [True, False]),
        "memory_arena": trial.suggest_categorical("ort.memory_arena", [True, False]),
        "memory_pattern": trial.suggest_categorical("ort.memory_pattern", [True, False]),
        "prepacking": prepacking,
        "flush_denormals": denormals,
        "pin_threads": pinned,
        "stop_spinning": stop,
    }
    if space.memory and options["memory_arena"]:
        options["arena_extend"] = trial.suggest_categorical("ort.arena_extend", list(ARENA_EXTEND))
    return options


def _openvino(trial: Any, space: Space) -> dict[str, Any]:
    hint = trial.suggest_categorical("openvino.hint", ["LATENCY", "THROUGHPUT"])
    extra: dict[str, str] = {}
    group = trial.suggest_categorical("openvino.dynamic_quantization_group", [0, 32, 64, 128])
    if group:
        extra["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = str(group)
    options: dict[str, Any] = {
        "performance_hint": hint,
        "num_streams": trial.suggest_int("openvino.streams", 1, space.cores),
        "inference_num_threads": trial.suggest_int("openvino.threads", 1, space.cores),
        "pin_threads": trial.suggest_categorical("openvino.pinning", [True, False]),
        "flush_denormals": trial.suggest_categorical("openvino.denormals", [None, True]),
        "extra": extra,
    }
    if space.memory:
        options["mmap"] = trial.suggest_categorical("openvino.mmap", [True, False])
    return options


class _Projection:
    """A stand-in trial that answers each suggestion from `params` where the value is one
    the space allows, else with the first allowed one; it keeps the answers it could take."""

    def __init__(self, params: dict[str, Any]) -> None:
        self.params, self.kept = params, {}

    def suggest_categorical(self, name: str, choices: list[Any]) -> Any:
        value = self.params.get(name, choices[0])
        if name in self.params and value in choices:
            self.kept[name] = value
        return value if value in choices else choices[0]

    def suggest_int(self, name: str, low: int, high: int) -> int:
        value = self.params.get(name, low)
        if name in self.params and isinstance(value, int) and low <= value <= high:
            self.kept[name] = value
            return value
        return low


def project(params: dict[str, Any], space: Space, model: ir.Model, base: CompileConfig) -> dict:
    """The part of `params` (a past winner, the defaults) that lies in this space: what a
    warm start may enqueue without handing the sampler a value it cannot take."""
    trial = _Projection(params)
    suggest(trial, space, model, base)
    return trial.kept


def default_params(space: Space, engine: str = "ort", precision: str = "fp32") -> dict[str, Any]:
    """The Optuna parameters of an engine's defaults at a precision (every pass, the engine's
    own options); `default_params(space)` are Kiln's defaults: ORT, fp32."""
    params: dict[str, Any] = {"engine": engine, f"{engine}.precision": precision}
    params |= {f"{engine}.passes.{g}": True for g in PASS_GROUPS}
    if has_hand_recipe(engine, precision):  # Kiln's own compile, not the recipe
        params[f"{engine}.{precision}.recipe"] = "kiln"
    if engine == "ort":
        params |= {
            "ort.threads": space.cores, "ort.prepacking": True, "ort.denormal_as_zero": False,
            "ort.pinning": False, "ort.optimization": "all", "ort.spinning": True,
            "ort.memory_arena": True, "ort.memory_pattern": True, "ort.calib_method": "minmax",
            "ort.execution_mode": "sequential", "ort.stop_spinning": None,
        }  # fmt: skip
        if space.memory:
            params["ort.arena_extend"] = next(iter(ARENA_EXTEND))  # ORT's own
    else:
        params |= {
            "openvino.hint": "LATENCY", "openvino.pinning": True, "openvino.streams": 1,
            "openvino.threads": space.cores, "openvino.dynamic_quantization_group": 0,
            "openvino.denormals": None,
        }  # fmt: skip
        if space.memory:
            params["openvino.mmap"] = True
        if not space.throughput:
            params["openvino.static"] = False
    if space.throughput and space.clients:
        params |= dict(SERVE_DEFAULTS) | ({"serve.buckets_per_dim": 0} if space.buckets else {})
    elif space.throughput:
        params |= {"batch": 1, "concurrency": 1}
    return params


SERVE_DEFAULTS = {"serve.max_batch": 16, "serve.max_delay_ms": 0.0}  # kiln serve's own
BUCKETED = 4  # sizes per dim of the bucketed seeds: the traffic's quartiles


# The engines' defaults at the precisions that win most often, tried first after Kiln's own:
# what `kiln optimize --backend auto --precision auto` would build, so a study starts at least
# where auto ends; the sampler explores from there.
SEEDS = (("openvino", "fp32"), ("ort", "int8"), ("openvino", "int8"))


def seed_params(space: Space) -> list[dict[str, Any]]:
    """The first trials: Kiln's defaults, then each engine's defaults at the precisions that
    win most often. For throughput those run at the largest batch, on one session and on one
    single-threaded session per core — where a server by hand would start."""
    pairs = [("ort", "fp32"), *SEEDS]
    seeds = [
        default_params(space, engine, precision)
        for engine, precision in pairs
        if engine in space.engines and precision in space.precisions
    ]
    if not space.throughput:
        return seeds
    if space.clients:  # also: batches as large as the clients can fill, sent at once
        full = max(b for b in BATCHES if b <= max(space.clients, 1))
        filled = [p | {"serve.max_batch": full, "serve.max_delay_ms": 0.0} for p in seeds]
        bucketed = [p | {"serve.buckets_per_dim": BUCKETED} for p in filled[:1]]
        return seeds + filled + (bucketed if space.buckets else [])
    large = [p | {"batch": max(BATCHES)} for p in seeds]
    per_core = [p | {"concurrency": space.cores} | _one_thread(p) for p in large]
    return seeds[:1] + large + (per_core if space.cores > 1 else [])


def recipe_params(space: Space) -> list[dict[str, Any]]:
    """Every hand recipe in the space, at the engine's default options: a study enqueues
    these before anything else, so even a short budget measures what a user would run by
    hand, and its pick is never behind one."""
    return [
        default_params(space, engine, precision) | {f"{engine}.{precision}.recipe": "hand"}
        for precision in space.precisions
        for engine in space.engines
        if engine in ENGINES_FOR[precision] and has_hand_recipe(engine, precision)
    ]


def _one_thread(params: dict[str, Any]) -> dict[str, Any]:
    if params["engine"] == "ort":
        return {"ort.threads": 1}
    return {"openvino.threads": 1, "openvino.streams": 1}


def choice_of(params: dict[str, Any], space: Space, model: ir.Model, base: CompileConfig) -> Choice:
    """The Choice a set of parameters stands for (as in the trial that suggested them)."""
    import optuna

    return suggest(optuna.trial.FixedTrial(params), space, model, base)
