"""What `kiln profile` runs: an original model (.onnx / zoo:NAME / .pt2) or a compiled artifact.

Either way the result is the ONNX graph the engine is given, the engine and its options, and
for an artifact the provenance that maps each compiled node to the user's original nodes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from kiln.artifact import Manifest
from kiln.errors import KilnError

BATCH_DIMS = ("batch", "batch_size", "N")


@dataclass
class Target:
    """A model ready to be compiled by a backend and profiled."""

    source: str  # what the user typed
    name: str
    model: ir.Model  # the graph the engine runs (nodes all named)
    runnable: ir.Model | str  # what the backend compiles: the model, or the artifact's file
    backend: str
    options: Any
    provenance: dict[str, dict[str, Any]] | None  # compiled node → origins; None if original
    manifest: Manifest | None = None

    @property
    def is_artifact(self) -> bool:
        return self.provenance is not None


def load_target(source: str, backend: str | None = None) -> Target:
    """Open `source`; `backend` None means the artifact's own engine, or ONNX Runtime."""
    from kiln.backends import default_options, get_backend, options_from_json

    if Path(source).is_dir():
        from kiln.artifact import read_artifact

        artifact = read_artifact(source)
        recorded = artifact.manifest.backend
        name = backend or recorded.name
        get_backend(name)
        if name == recorded.name:
            options = options_from_json(name, recorded.options)
        else:  # run elsewhere than it was built for: that engine's defaults
            options = default_options(name)
        return Target(
            source=source,
            name=Path(source).name.removesuffix(".kiln"),
            model=ir.load(str(artifact.model_path)),  # graph only: weights stay on disk
            runnable=str(artifact.model_path),
            backend=name,
            options=options,
            provenance=artifact.provenance(),
            manifest=artifact.manifest,
        )
    from kiln.ir import stamp_origins

    name = backend or "ort"
    get_backend(name)
    loaded = _load(source)
    # Unnamed nodes get names here, so the engine's per-node records can be matched to them.
    stamp_origins(loaded.model)
    return Target(
        source=source,
        name=loaded.name,
        model=loaded.model,
        runnable=loaded.model,
        backend=name,
        options=default_options(name),
        provenance=None,
    )


def _load(source: str) -> Any:
    """An original model: .onnx or zoo:NAME, or a saved torch.export program (exported to
    ONNX, as `kiln optimize` does)."""
    from kiln.ir import load_model
    from kiln.ir.load import PT2_SUFFIX

    if source.endswith(PT2_SUFFIX):
        from kiln.frontend import load_pt2

        return load_pt2(source)
    return load_model(source)


def target_feeds(
    target: Target,
    batch: int = 1,
    shapes: dict[str, tuple[int, ...]] | None = None,
    say: Callable[[str], None] = lambda _msg: None,
) -> dict[str, np.ndarray]:
    """Synthesised inputs at the given batch size (and --shape overrides), at the dims an
    artifact recorded; where the model leaves a dim or a scalar to guess, fitted on the
    engine as `kiln optimize` fits them."""
    from kiln.ir.inputs import default_dims, synthesize
    from kiln.ir.ladder import Guess, fit_inputs, free_of

    if batch < 1:
        raise KilnError(f"--batch {batch}: the batch size must be 1 or more.")
    recorded = target.manifest.dims if target.manifest else {}
    dims = {**(recorded or default_dims(target.model)), **dict.fromkeys(BATCH_DIMS, batch)}
    fit = Guess(dict(shapes or {}))
    if free_of(target.model, shapes):
        from kiln.backends import get_backend

        exe = get_backend(target.backend).compile(target.runnable, target.options)
        fit = fit_inputs(target.model, shapes, exe.run, say, dims)
    return synthesize(target.model, dims, shapes=fit.shapes, scalars=fit.scalars)
