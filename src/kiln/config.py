"""`CompileConfig`: every decision Kiln makes about one compile, as data.

It is what `kiln.compile` takes, what the manifest records (`manifest.json` → "config") and
what rebuilds an artifact (`kiln optimize --config ARTIFACT/manifest.json`); it is also the
search space of the tuner. Two compiles of the same model with equal configs make the same
artifact (up to timing-driven choices, which only `engine="auto"` / `precision="auto"` make).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.errors import KilnError

ENGINES = ("ort", "openvino")
PRECISIONS = ("fp32", "bf16", "int8", "int4")
CALIBRATION_METHODS = ("minmax", "entropy", "percentile")
AUTO = "auto"
# Hand recipes: an engine's own tool with its defaults on the original graph (kiln.precision.
# recipes says what each runs), and the engine and precision each is for. HAND is resolved
# by the compile to the one a user would pick for the model (transformer or CNN).
HAND = "hand"
RECIPES = {
    "nncf-transformer": ("openvino", "int8"),
    "nncf-default": ("openvino", "int8"),
    "ort-dynamic": ("ort", "int8"),
    "ort-static": ("ort", "int8"),
    "openvino-bf16": ("openvino", "bf16"),
}


@dataclass(frozen=True)
class CompileConfig:
    """How an artifact is made.

    engine          ort | openvino | auto (every installed engine, the fastest verified kept)
    engine_options  overrides of the engine's settings for this precision (OrtOptions /
                    OpenVinoOptions fields, e.g. {"intra_op_threads": 2}), memory included:
                    ORT prepacking, memory_arena, arena_extend, memory_pattern; OpenVINO mmap
    precision       fp32 | bf16 | int8 | int4 | auto
    pipeline        pass names in order; None: the engine's default pipeline
    metric, max_drop  the accuracy budget below fp32 (see kiln.verify.Budget)
    calib, calib_method, block_size  calibration samples and method; int4 block size
    inputs          reference inputs (.npz) for verification; None: synthesized
    shapes          input name → shape, for dynamic dims Kiln cannot guess
    verify          False only when the user says --no-verify
    recipe          None: Kiln's own; or a hand recipe (RECIPES, or "hand": the model's) on
                    the original graph (pipeline ()), the guard keeping layers only past budget
    partition       none: one part; auto: the graph's independent branches and their join as
                    parts, each placed on the engine measured fastest for it — a graph without
                    branches: its chain of segments (kiln.compiler.partition_chain) — kept only
                    when faster than the best single-engine build (kiln.compiler.partition); or
                    a placement "image=openvino,text=ort:bf16" or "s01=openvino" (unnamed parts:
                    `engine`)
    static          OpenVINO compiled for the dims of the inputs it is verified on (its
                    `dim_overrides`; ENGINE-NOTES: BERT batch 8 1.4x faster so on one Xeon,
                    0.95-1.04x elsewhere); a run at other dims compiles the dynamic model on
                    first need. Kept only for auto's OpenVINO candidates; ORT refuses it.
                    Auto with `shapes` given times each unquantized OpenVINO candidate static too
                    (kiln.compiler.select.static_twins)
    """

    engine: str = "ort"
    engine_options: Mapping[str, Any] = field(default_factory=dict)
    precision: str = "fp32"
    pipeline: tuple[str, ...] | None = None
    metric: str = "cosine"
    max_drop: float = 0.01
    calib: str | None = None
    calib_method: str = "minmax"
    block_size: int = 32
    inputs: str | None = None
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    verify: bool = True
    recipe: str | None = None
    partition: str = "none"
    static: bool = False

    def __post_init__(self) -> None:
        if self.engine not in (*ENGINES, AUTO):
            raise KilnError(
                f"unknown backend '{self.engine}'; use one of {', '.join(ENGINES)} or auto."
            )
        if self.precision not in (*PRECISIONS, AUTO):
            raise KilnError(
                f"unknown precision '{self.precision}'; use one of {', '.join(PRECISIONS)} or auto."
            )
        if self.calib_method not in CALIBRATION_METHODS:
            raise KilnError(
                f"unknown --calib-method '{self.calib_method}'; use one of "
                f"{', '.join(CALIBRATION_METHODS)}."
            )
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise KilnError(
                f"--block-size {self.block_size}: use a power of two ≥ 16, e.g. 32 or 128."
            )
        if not 0 <= self.max_drop < 1:
            raise KilnError(
                f"--max-drop {self.max_drop} is a fraction: use a value in [0, 1), e.g. 0.01."
            )
        _check_recipe(self)
        if self.static and self.engine == "ort":
            raise KilnError(
                "--static applies to OpenVINO: ONNX Runtime ran bert-base slower with its dims "
                "fixed (0.92x on an AVX-512 EPYC); use --backend openvino or auto."
            )
        partition_placement(self.partition)  # a bad placement is refused before any work
        if self.recipe is not None:  # a recipe runs on the original graph: no passes
            object.__setattr__(self, "pipeline", ())
        # Normalise containers so that equal configs compare equal and serialise the same.
        object.__setattr__(self, "engine_options", _engine_options(self.engine_options))
        object.__setattr__(self, "shapes", {k: _shape(k, v) for k, v in self.shapes.items()})
        if self.pipeline is not None:
            object.__setattr__(self, "pipeline", tuple(self.pipeline))
        for name in ("inputs", "calib"):  # recorded absolute: a rebuild may run elsewhere
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, str(Path(value).absolute()))

    @property
    def is_auto(self) -> bool:
        return AUTO in (self.engine, self.precision)

    def replace(self, **changes: Any) -> CompileConfig:
        return dataclasses.replace(self, **changes)

    def budget(self) -> Any:
        """The accuracy budget (a kiln.verify.Budget; a user metric is imported here)."""
        from kiln.verify import budget_for

        return budget_for(self.metric, self.max_drop)

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["pipeline"] = list(self.pipeline) if self.pipeline is not None else None
        data["shapes"] = {k: list(v) for k, v in self.shapes.items()}
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any], where: str = "config") -> CompileConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise KilnError(
                f"{where}: unknown CompileConfig field '{unknown[0]}'; the fields are "
                f"{', '.join(sorted(known))}."
            )
        try:
            return cls(**data)
        except TypeError as exc:
            raise KilnError(f"{where}: not a valid CompileConfig ({exc}).") from None


def read_config(path: str | Path) -> tuple[CompileConfig, str | None]:
    """A CompileConfig from a JSON file: an artifact's manifest.json (its "config", and the
    source model it was built from), an artifact directory, or a bare config object."""
    path = Path(path)
    if path.is_dir():
        path = path / "manifest.json"
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise KilnError(f"{path}: cannot read the config ({exc.strerror or exc}).") from None
    except ValueError as exc:
        raise KilnError(f"{path}: not JSON ({exc}).") from None
    if not isinstance(data, dict):
        raise KilnError(f"{path}: a config must be a JSON object.")
    if "config" not in data:
        return CompileConfig.from_json(data, str(path)), None
    if not isinstance(data["config"], dict):
        raise KilnError(f'{path}: its "config" must be a JSON object.')
    source = data.get("source")
    source = source.get("path") if isinstance(source, dict) else None
    return CompileConfig.from_json(data["config"], f"{path} (config)"), source


def _check_recipe(config: CompileConfig) -> None:
    recipe = config.recipe
    if recipe is None:
        return
    if recipe != HAND and recipe not in RECIPES:
        raise KilnError(
            f"unknown recipe '{recipe}'; use one of {', '.join([HAND, *RECIPES])} or none."
        )
    if config.pipeline:
        raise KilnError(
            f"recipe '{recipe}' runs on the original graph: give no pipeline (or pipeline=())."
        )
    wanted = RECIPES.get(recipe)
    given = (config.engine, config.precision)
    if wanted and AUTO not in given and given != wanted:
        raise KilnError(
            f"recipe '{recipe}' is {wanted[0]} {wanted[1]}, not {given[0]} {given[1]}; use "
            f"--backend {wanted[0]} --precision {wanted[1]}."
        )


NO_PARTITION = "none"


def partition_placement(text: str) -> dict[str, tuple[str, str | None]]:
    """An explicit placement, "PART=ENGINE[:PRECISION],...", as {part: (engine, precision)};
    {} for none and auto. KilnError naming what is wrong (the parts themselves are checked
    against the model when it is loaded)."""
    if text in (NO_PARTITION, AUTO):
        return {}
    placement: dict[str, tuple[str, str | None]] = {}
    for item in str(text).split(","):
        part, _, target = item.strip().partition("=")
        engine, _, precision = target.partition(":")
        if not part or not engine:
            raise KilnError(
                f"--partition '{text}': give none, auto, or PART=ENGINE[:PRECISION],... "
                "e.g. image=openvino,text=ort."
            )
        if engine not in ENGINES:
            raise KilnError(
                f"--partition '{text}': unknown engine '{engine}' for part '{part}'; use one "
                f"of {', '.join(ENGINES)}."
            )
        if precision and precision not in PRECISIONS:
            raise KilnError(
                f"--partition '{text}': unknown precision '{precision}' for part '{part}'; "
                f"use one of {', '.join(PRECISIONS)}."
            )
        if part in placement:
            raise KilnError(f"--partition '{text}': part '{part}' is placed twice.")
        placement[part] = (engine, precision or None)
    return placement


def _engine_options(options: Any) -> dict[str, Any]:
    """`engine_options` as a dict: an engine's options object (OrtOptions, OpenVinoOptions)
    is taken as its JSON fields, as the manifest records them."""
    if hasattr(options, "to_json"):
        options = options.to_json()
    if not isinstance(options, Mapping):
        raise KilnError(
            f"engine_options must be a dict of the engine's settings or its options object "
            f"(e.g. OpenVinoOptions(...)), not {type(options).__name__}."
        )
    return dict(options)


def _shape(name: str, value: Any) -> tuple[int, ...]:
    """A shape as given: a sequence of sizes, or one int (a named dim, as `--shape seq=32`)."""
    if isinstance(value, int):
        return (int(value),)
    try:
        return tuple(int(d) for d in value)
    except (TypeError, ValueError):
        raise KilnError(
            f"shapes['{name}'] = {value!r}: give sizes, e.g. (1, 3, 224, 224), or one int for a "
            "named dim, e.g. {'seq': 512}."
        ) from None
