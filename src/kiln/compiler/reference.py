"""The reference a compiled model is judged against: the original in ONNX Runtime, basic
optimisation, fp32, on the user's inputs or on synthesized ones."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx_ir as ir

from kiln.backends import get_backend
from kiln.backends.ort import OrtOptions
from kiln.errors import KilnError
from kiln.ir.inputs import synthesize
from kiln.ir.ladder import FIRST_GUESS, Guess, free_of, record_fit
from kiln.ir.ladder import fit_inputs as ladder_fit
from kiln.verify import max_abs_diff

REFERENCE_OPTIONS = OrtOptions(optimization="basic")
Feeds = dict[str, np.ndarray]
SYNTHESIZED = "synthesized"


def copy_model(model: ir.Model) -> ir.Model:
    copy = ir.serde.deserialize_model(ir.serde.serialize_model(model))
    external = [
        v.const_value
        for v in model.graph.initializers.values()
        if isinstance(v.const_value, ir.ExternalTensor)
    ]
    if external:  # weights left on disk are found relative to the model's directory
        ir.external_data.set_base_dir(copy.graph, external[0].base_dir)
    return copy


def reference_executable(model: ir.Model) -> Any:
    return get_backend("ort").compile(model, REFERENCE_OPTIONS)


def fit_inputs(exe: Any, model: ir.Model, shapes: dict | None, say: Callable[[str], None]) -> Guess:
    """The compile's fit (`kiln.ir.ladder.fit_inputs` on the reference), kept in the model's
    `kiln.dims` (`record_fit`): the artifact's manifest and model file then carry the dims
    every other verb synthesizes inputs at."""
    fit = ladder_fit(model, shapes, exe.run, say)
    record_fit(model, fit)
    return fit


def fit_original(
    model: ir.Model,
    shapes: dict | None = None,
    say: Callable[[str], None] = lambda _m: None,
    dims: dict[str, int] | None = None,
) -> Guess:
    """The same fit for a verb that runs a model (bench, debug, compare): the reference is
    only compiled when the first guess had to make up a dim or a scalar's value."""
    if not free_of(model, shapes):
        return Guess(dict(shapes or {}))
    return ladder_fit(model, shapes, reference_executable(model).run, say, dims)


def reference_feeds(
    model: ir.Model,
    given: list[Feeds] | None,
    source: str,
    fit: Guess,
    sets: int = 2,
) -> tuple[list[Feeds], str]:
    """The input sets verification runs on: the given ones, else `sets` synthesized ones at
    the fitted shapes."""
    if given:
        return given, source
    feeds = [
        synthesize(model, seed=seed, shapes=fit.shapes, scalars=fit.scalars) for seed in range(sets)
    ]
    return feeds, SYNTHESIZED if fit.label == FIRST_GUESS else f"{SYNTHESIZED} ({fit.label})"


def owned(value: Any) -> Any:
    """An output as arrays of its own. ONNX Runtime's outputs are views into its session's
    memory (base: a PyCapsule), and one held pins the whole activation arena after the
    session is gone: bert-base-4k's reference outputs at 2,048 tokens (12 MB) held 430 MiB,
    for every candidate a compile builds. Copied once: the reference lives for the compile."""
    if isinstance(value, list | tuple):
        return [owned(v) for v in value]
    if isinstance(value, np.ndarray) and not value.flags.owndata:
        return value.copy()
    return value


def _elements(value: object) -> int:
    """Values held by an output or input (a sequence holds the sum of its tensors')."""
    if isinstance(value, list | tuple):
        return sum(_elements(v) for v in value)
    return int(np.size(value))


def _refuse_nothing_to_compare(
    feeds: list[Feeds], outputs: list[list[np.ndarray]], source: str
) -> None:
    """Nothing compared is not verified: refuse synthesized inputs (e.g. `--shape x=0x16`) on
    which every output is empty. The user's own inputs are taken as given: an empty set is a
    case models must handle (ONNX's own tests reduce over empty sets)."""
    if not source.startswith(SYNTHESIZED) or any(_elements(o) for outs in outputs for o in outs):
        return
    empty = [
        f"{name} {'x'.join(map(str, np.shape(value)))}"
        for name, value in feeds[0].items()
        if not isinstance(value, list | tuple) and np.size(value) == 0
    ]
    because = f" (inputs with no elements: {', '.join(empty)})" if empty else ""
    raise KilnError(
        f"on these inputs ({source}) every output of the original is empty{because}: "
        "verification would compare nothing. Give non-zero shapes (--shape) or other --inputs."
    )


def run_reference(exe: Any, feeds: list[Feeds], source: str) -> list[list[np.ndarray]]:
    outputs = [[owned(o) for o in exe.run(f)] for f in feeds]
    _refuse_nothing_to_compare(feeds, outputs, source)
    return outputs


def engine_noise(
    original: ir.Model,
    feeds: list[Feeds],
    reference: list[list[np.ndarray]],
    engine: str,
    options: Any,
) -> dict[str, float]:
    """Per output, how far the untouched original moves under the artifact's engine and
    options (another engine's kernels round differently too)."""
    exe = get_backend(engine).compile(original, options)
    names = [v.name for v in original.graph.outputs]
    noise = dict.fromkeys(names, 0.0)
    for feed, ref_set in zip(feeds, reference, strict=True):
        for name, ref, new in zip(names, ref_set, exe.run(feed), strict=True):
            noise[name] = max(noise[name], max_abs_diff(ref, new))
    return noise
