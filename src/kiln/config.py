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

    def __post_init__(self) -> None:
        if self.engine not in (*ENGINES, AUTO):
            raise KilnError(
                f"unknown backend '{self.engine}'; use one of {', '.join(ENGINES)} or auto."
            )
        if self.precision not in (*PRECISIONS, AUTO):
            raise KilnError(
                f"unknown precision '{self.precision}'; use one of {', '.join(PRECISIONS)} "
                "or auto."
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
        # Normalise containers so that equal configs compare equal and serialise the same.
        object.__setattr__(self, "engine_options", dict(self.engine_options))
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
        raise KilnError(f"{path}: its \"config\" must be a JSON object.")
    source = data.get("source")
    source = source.get("path") if isinstance(source, dict) else None
    return CompileConfig.from_json(data["config"], f"{path} (config)"), source


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
