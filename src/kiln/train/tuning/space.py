"""The training tuner's search space: the knobs of a TrainConfig searched at a fixed global
batch, each an Optuna categorical around the user's base, and the seeds measured first."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kiln.errors import KilnError
from kiln.train.config import TrainConfig

MAX_ACCUMULATION = 32  # micro-batches per step: beyond this the per-step overhead dominates


@dataclass(frozen=True)
class TrainSpace:
    """The knobs searched, each an Optuna categorical over `choices`, around `base`."""

    base: TrainConfig
    global_batch: int
    cores: int
    choices: dict[str, tuple[Any, ...]]

    @classmethod
    def build(cls, base: TrainConfig, global_batch: int, cores: int, features: list[str],
              blocks: int, narrow: dict[str, list[Any]] | None = None) -> TrainSpace:  # fmt: skip
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


def seeds(space: TrainSpace) -> list[dict[str, Any]]:
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
