"""When synthesized inputs do not run: a short ladder of other guesses for what Kiln could
not know — the sizes of dims nothing names a value for, and the values of scalar inputs
(a sample rate) — each a complete set of input shapes and scalar values to try in turn."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx_ir as ir

from kiln.errors import KilnError
from kiln.ir.inputs import (
    SAMPLE_RATES,
    bind_dims,
    default_dims,
    input_shape,
    misfit_shape,
    model_inputs,
    named_dims,
    synthesize,
)

# Sizes tried for unresolved dims, after the first guess: realistic ones first (a model that
# runs on a 1-pixel image or a 1-token sequence is verified on almost nothing), multiples of
# the strides and windows models divide by; 1 last.
DIM_LADDER = (32, 64, 128, 16, 256, 512, 1)
MOST_TRIES = 16
FIRST_GUESS = "first guess"


@dataclass(frozen=True)
class Free:
    """What the first guess left open: dims (by name, or `input[axis]` when unnamed) whose
    size no --shape, metadata or convention gives, and numeric scalar inputs."""

    dims: tuple[str, ...] = ()
    scalars: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.dims or self.scalars)


@dataclass(frozen=True)
class Guess:
    """One rung: a shape for every input and a value for some scalar inputs."""

    shapes: dict[str, tuple[int, ...]]
    scalars: dict[str, float] = field(default_factory=dict)
    label: str = FIRST_GUESS


def _given(model: ir.Model, shapes: dict[str, tuple[int, ...]]) -> set[str]:
    """Dim names fixed by the user's --shape or by the model's `kiln.dims` metadata (the
    conventional sizes, seq=128 and the like, are guesses: the ladder may change them)."""
    fixed = set(json.loads(model.metadata_props.get("kiln.dims", "{}")))
    inputs = model_inputs(model)
    for key in shapes:
        if key in inputs:
            fixed |= {name for _, name in named_dims(inputs[key])}
        else:
            fixed.add(key)
    return fixed


def _is_batch(axis: int, rank: int) -> bool:
    """The leading dim of a tensor of rank ≥ 2 is a batch: 1 runs, and the ladder leaves it."""
    return axis == 0 and rank >= 2


def free_of(model: ir.Model, shapes: dict[str, tuple[int, ...]] | None) -> Free:
    """The dims and scalars a first guess had to make up (batch dims excepted: 1 runs)."""
    shapes = shapes or {}
    fixed, dims, scalars = _given(model, shapes), [], []
    for name, value in model_inputs(model).items():
        if value.shape is None:
            continue
        if value.shape.rank() == 0 or all(d == 1 for d in value.shape):
            is_numeric = value.dtype is not None and value.dtype != ir.DataType.STRING
            if is_numeric and value.dtype != ir.DataType.BOOL:
                scalars.append(name)
            continue
        if name in shapes:
            continue
        for axis, dim in enumerate(value.shape):
            if isinstance(dim, int) and dim > 0:
                continue
            label = str(dim.value) if not isinstance(dim, int) and dim.value else ""
            label = label or f"{name}[{axis}]"
            if _is_batch(axis, value.shape.rank()) or label in fixed:
                continue
            dims.append(label)
    return Free(tuple(dict.fromkeys(dims)), tuple(scalars))


def _shapes_at(
    model: ir.Model,
    shapes: dict[str, tuple[int, ...]],
    free: Free,
    size: int | None,
    dims: dict[str, int] | None = None,
) -> dict[str, tuple[int, ...]]:
    """Every input's shape with the free dims at `size` (None: the first guess's); `dims` as
    `synthesize` takes them (a batch size)."""
    dims = bind_dims(model, {**default_dims(model), **(dims or {})}, shapes)
    out = {}
    for name, value in model_inputs(model).items():
        shape = list(input_shape(value, dims, shapes))
        for axis, dim in enumerate(value.shape or []):
            label = str(dim.value) if not isinstance(dim, int) and dim.value else ""
            if size is not None and (label or f"{name}[{axis}]") in free.dims:
                shape[axis] = size
        out[name] = tuple(shape)
    return out


def ladder(
    model: ir.Model, shapes: dict[str, tuple[int, ...]] | None, dims: dict[str, int] | None = None
) -> list[Guess]:
    """The rungs to try after the first guess failed, at most MOST_TRIES of them: scalar
    values first (a wrong sample rate is the commonest refusal), then each dim size, each
    with the scalars' first guess and then the other sample rates."""
    shapes = dict(shapes or {})
    free = free_of(model, shapes)
    if not free:
        return []
    sizes: list[int | None] = [None] + (list(DIM_LADDER) if free.dims else [])
    values = [{}] + [dict.fromkeys(free.scalars, float(v)) for v in SAMPLE_RATES]
    values += [dict.fromkeys(free.scalars, 1.0)] if free.scalars else []
    rungs, seen = [], {_key(_shapes_at(model, shapes, free, None, dims), {})}
    for size in sizes:
        for scalars in values if free.scalars else [{}]:
            at = _shapes_at(model, shapes, free, size, dims)
            if _key(at, scalars) in seen:
                continue  # the first guess, or a size it already had
            seen.add(_key(at, scalars))
            parts = [f"{d}={size}" for d in free.dims] if size is not None else []
            parts += [f"{k}={v:g}" for k, v in scalars.items()]
            rungs.append(Guess(at, scalars, ", ".join(parts)))
    return rungs[:MOST_TRIES]


def _key(shapes: dict[str, tuple[int, ...]], scalars: dict[str, float]) -> tuple:
    return tuple(sorted(shapes.items())), tuple(sorted(scalars.items()))


def fit_inputs(
    model: ir.Model,
    shapes: dict[str, tuple[int, ...]] | None,
    run: Callable[[dict[str, np.ndarray]], Any],
    say: Callable[[str], None] = lambda _m: None,
    dims: dict[str, int] | None = None,
) -> Guess:
    """Shapes and scalar values on which `run` (the model in an engine, handed in by the
    caller) succeeds: the first guess, else the first rung of the ladder that runs (each try
    logged), else a KilnError naming what Kiln could not resolve and what to pass. `dims` are
    the values `synthesize` starts from (a batch size, an artifact's recorded dims). Every
    verb fits its synthesized inputs here, so they all agree on them."""
    first = Guess(dict(shapes or {}))
    try:
        run(synthesize(model, dims, shapes=first.shapes))
        return first
    except KilnError as exc:
        failure = exc
    misfit = misfit_shape(model, shapes)
    if misfit:  # no guess can fix the user's own shape
        raise KilnError(misfit) from None
    rungs = ladder(model, shapes, dims)
    for number, guess in enumerate(rungs, 1):
        say(f"the original does not run on the first guess; trying {guess.label} "
            f"({number}/{len(rungs)})")  # fmt: skip
        try:
            run(synthesize(model, dims, shapes=guess.shapes, scalars=guess.scalars))
            return guess
        except KilnError:
            continue
    raise KilnError(_unfitted(model, shapes, dims, failure, len(rungs))) from None


def _unfitted(
    model: ir.Model,
    shapes: dict | None,
    dims: dict[str, int] | None,
    failure: KilnError,
    tries: int,
) -> str:
    feeds = synthesize(model, dims, shapes=shapes)
    tried = ", ".join(f"{k}={'x'.join(map(str, v.shape))}" for k, v in feeds.items())
    free = free_of(model, shapes)
    what = [f"dim {d}" for d in free.dims] + [f"scalar input {s}" for s in free.scalars]
    flags = [
        f"--shape {d}=N" if "[" not in d else f"--shape {d.split('[')[0]}=D0xD1x..."
        for d in free.dims
    ]
    if free.scalars:
        flags.append(f"--inputs in.npz (with {', '.join(free.scalars)})")
    if not flags:
        flags = ["--shape INPUT=D0xD1x...", "--inputs in.npz"]
    ladder_note = f" nor on {tries} other guesses" if tries else ""
    unresolved = f" Unresolved: {', '.join(what)}." if what else ""
    return (
        f"the original model does not run on synthesized inputs ({tried}){ladder_note}: "
        f"{str(failure).rstrip('.')}.{unresolved} Pass {' or '.join(dict.fromkeys(flags))}."
    )


def record_fit(model: ir.Model, guess: Guess) -> None:
    """Keep the sizes a fit gave the model's free dims in its `kiln.dims` metadata (an unnamed
    one as `input[axis]`), as the zoo keeps its own: every later reader of the model (an
    artifact's manifest `dims` and model file, `kiln.Session`, the cost model, every verb)
    then synthesizes inputs that run, without fitting again. A first guess without --shape
    is what synthesis gives anyway: nothing to keep."""
    if guess.label == FIRST_GUESS and not guess.shapes:
        return
    free = set(free_of(model, None).dims)
    dims = bind_dims(model, default_dims(model), guess.shapes)
    inputs = model_inputs(model)
    for name, shape in guess.shapes.items():  # unnamed dims, as `input[axis]`
        if name in inputs and len(shape) == len(inputs[name].shape or ()):
            dims |= {f"{name}[{axis}]": size for axis, size in enumerate(shape)}
    found = {name: size for name, size in dims.items() if name in free}
    if found:
        recorded = json.loads(model.metadata_props.get("kiln.dims", "{}"))
        model.metadata_props["kiln.dims"] = json.dumps({**recorded, **found})
