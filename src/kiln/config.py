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
    """How an artifact is made: each field one decision, its docstring what it means (and
    the help of the `kiln optimize` flag that sets it)."""

    engine: str = "ort"
    """Engine the artifact runs on: ort, openvino, or auto (build, verify and time each
    installed engine; keep the fastest)."""
    engine_options: Mapping[str, Any] = field(default_factory=dict)
    """Overrides of the engine's settings for this precision (OrtOptions / OpenVinoOptions
    fields, e.g. {"intra_op_threads": 2}), memory included: ORT prepacking, memory_arena,
    arena_extend, memory_pattern; OpenVINO mmap."""
    precision: str = "fp32"
    """fp32 (lossless, the default); bf16 (OpenVINO), int8 (ONNX Runtime; OpenVINO through
    NNCF) or int4 (ONNX Runtime, MatMul weights), each under an accuracy guard that keeps the
    most sensitive layers in fp32 until the metric is within max_drop of fp32; or auto: every
    precision on every engine that runs it, the fastest within budget kept."""
    pipeline: tuple[str, ...] | None = None
    """Pass names in order; None: the engine's default pipeline."""
    metric: str = "cosine"
    """Accuracy metric for lower precisions: cosine, top1 (argmax agreement), max-abs
    (relative to the output's scale), or module:function(outputs_ref, outputs_new) -> float,
    higher is better."""
    max_drop: float = 0.01
    """How far the metric may fall below fp32's, relative (0.01 = 1 %)."""
    calib: str | None = None
    """Calibration samples for static int8: an .npz (arrays stacked on a first sample axis,
    or one sample) or a directory of them. Without reference inputs a quarter is held out to
    judge accuracy. Without calibration samples Kiln calibrates on synthetic inputs and says
    so."""
    calib_method: str = "minmax"
    """ONNX Runtime calibration: minmax, entropy or percentile."""
    block_size: int = 32
    """int4: weights per quantization block (a power of two, 16 or more)."""
    inputs: str | None = None
    """Reference inputs (.npz) for verification (default: synthesized from the input specs)."""
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    """Shape of a synthesized input, INPUT=D0xD1x... (or DIM=N for a named dim), for dynamic
    dims Kiln cannot guess."""
    verify: bool = True
    """Verify the artifact against the original on reference inputs (off only when the user
    says so: an unverified artifact)."""
    recipe: str | None = None
    """None: Kiln's own; or a hand recipe (RECIPES, or "hand": the model's) on the original
    graph (no passes), the guard keeping layers in fp32 only past the budget."""
    partition: str = "none"
    """none (one part); auto: the model's independent branches (e.g. a two-tower model's
    image and text towers) and their join as parts, each on the installed engine measured
    fastest for it, run at once on shares of the cores — or, for a chain of layers, its
    segments (cut where one tensor carries everything on) each on the engine Kiln's build of
    it runs fastest, neighbours on one engine one part; kept only when clearly faster than the
    best single-engine build (in every timing round, or 1.05x in the median with two rounds in
    three). Or a placement PART=ENGINE[:PRECISION],... e.g. image=openvino,text=ort, or for a
    chain s01=openvino,s03=openvino (the segments' sNN; an unknown one lists them; unnamed
    parts take the engine)."""
    static: bool = False
    """OpenVINO: compile for the dims of the inputs verified on (static shapes can be faster
    for fixed-size traffic, and can be slower: time it); a run at other dims compiles the
    dynamic model on first use. With engine auto, for the OpenVINO candidates only; auto with
    shapes given already times each fp32/bf16 OpenVINO candidate both ways. ONNX Runtime
    refuses it."""

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
                "--static applies to OpenVINO: ONNX Runtime runs no faster with its dims fixed "
                "(docs/contributing/engine-notes.md); use --backend openvino or auto."
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


@dataclass(frozen=True)
class TimingConfig:
    """How a compile times what it built against ONNX Runtime as-is (the manifest's
    benchmark) and how auto times its candidates to choose: `kiln optimize`'s --rounds and
    --runs and `kiln.compile`'s `rounds` and `runs`, one default for both."""

    rounds: int = 5
    """Interleaved timing rounds (0: no timing; 3 or more to tell a speedup from noise)."""
    runs: int = 10
    """Runs per engine per round."""


TIMING = TimingConfig()


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
