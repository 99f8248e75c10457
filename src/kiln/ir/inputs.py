"""Reference inputs: synthesised from the model's input specs, or read from the user's file.

Synthesised inputs follow what the model will see in use: token ids inside the vocabulary
(the table the ids index), masks of ones (odd seeds: with trailing padding masked out),
segment ids of zeros, images in [0, 1].

Files are .npz archives of one array per input, read without unpickling (`allow_pickle=False`:
loading a pickle can run code). numpy pickles object arrays, so string inputs are saved as
numpy text arrays, e.g. `np.savez(path, text=np.array(["a query", "another"]))` (dtype '<U..';
UTF-8 bytes, dtype 'S..', are read too); Kiln turns them into the object arrays that string
tensors take.
"""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import onnx_ir as ir

from kiln.errors import KilnError

DEFAULT_DIMS = {"batch": 1, "batch_size": 1, "N": 1, "seq": 128, "sequence": 128}
# Scalar inputs named like a sample rate (voice-activity detectors, ASR front-ends).
SAMPLE_RATE_NAMES = {"sr", "sample_rate", "sampling_rate", "samplerate"}
SAMPLE_RATES = (16000, 8000, 22050, 44100, 48000)


def default_dims(model: ir.Model) -> dict[str, int]:
    """Values for symbolic dims: the zoo's `kiln.dims` metadata, else common defaults."""
    dims = dict(DEFAULT_DIMS)
    if "kiln.dims" in model.metadata_props:
        dims.update(json.loads(model.metadata_props["kiln.dims"]))
    return dims


def input_shape(
    value: ir.Value, dims: dict[str, int], shapes: dict[str, tuple[int, ...]] | None = None
) -> tuple[int, ...]:
    """The shape to synthesise: the user's --shape, else static dims, named dims from `dims`
    (an unnamed one as `input[axis]`, as a fit records it), and for the rest a guess from the
    input's kind (see `_guess_dim`)."""
    if shapes and value.name in shapes:
        return shapes[value.name]
    shape = value.shape
    if shape is None:
        raise KilnError(
            f"input '{value.name}' has no shape; give its shape with --shape "
            f"{value.name}=D0xD1x... or real inputs with --inputs."
        )
    out = []
    for axis, dim in enumerate(shape):
        if isinstance(dim, int) and dim > 0:
            out.append(dim)
        elif not isinstance(dim, int) and dim.value and str(dim.value) in dims:
            out.append(dims[str(dim.value)])
        elif f"{value.name}[{axis}]" in dims:
            out.append(dims[f"{value.name}[{axis}]"])
        else:
            out.append(_guess_dim(value, axis))
    return tuple(out)


def input_bytes(model: ir.Model, dims: dict[str, int]) -> int:
    """Bytes of the model's inputs at `dims` (other dims as `synthesize` would guess them),
    computed from shapes alone: nothing is allocated."""
    total = 0
    for value in model_inputs(model).values():
        try:
            itemsize = value.dtype.itemsize if value.dtype is not None else 4
        except TypeError:  # strings: no fixed width; count a pointer each
            itemsize = 8
        total += int(np.prod(input_shape(value, dims), dtype=object)) * max(int(itemsize), 1)
    return total


def _guess_dim(value: ir.Value, axis: int) -> int:
    """Batch 1; image height/width 224 (volumes 64); sequence length 128; otherwise 1."""
    rank = value.shape.rank() if value.shape is not None else 0
    is_float = value.dtype is not None and value.dtype.is_floating_point()
    if axis == 0:
        return 1
    if is_float and rank == 4 and axis >= 2:
        return 224
    if is_float and rank == 5 and axis >= 2:
        return 64
    if not is_float and rank == 2 and axis == 1:
        return 128
    return 1


def parse_shapes(specs: list[str]) -> dict[str, tuple[int, ...]]:
    """`--shape x=1x3x224x224` (repeatable) into {input name: shape}."""
    shapes = {}
    for spec in specs:
        name, _, text = spec.partition("=")
        try:
            shape = tuple(int(d) for d in text.lower().split("x"))
        except ValueError:
            shape = ()
        if not name or not shape or any(d < 0 for d in shape):
            raise KilnError(f"--shape {spec}: expected INPUT=D0xD1x..., e.g. x=1x3x224x224.")
        shapes[name] = shape
    return shapes


def _vocab_size(value: ir.Value) -> int | None:
    """Rows of the embedding table an id input indexes, following casts and reshapes."""
    frontier, seen = [value], set()
    while frontier:
        current = frontier.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        for user, index in current.uses():
            if user.op_type == "Gather" and index == 1:
                table = user.inputs[0]
                shape = table.shape if table is not None else None
                if shape is not None and isinstance(shape[0], int):
                    return shape[0]
            if user.op_type in {"Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten"}:
                frontier.extend(user.outputs)
    return None


def is_mask_input(name: str | None) -> bool:
    """Attention/padding masks, recognised by name (attention_mask, input_mask, src_mask, ...):
    the one place Kiln decides an input is a mask (synthesis fills it with ones, padding with
    zeros)."""
    return "mask" in (name or "").lower()


def _padding_mask(shape: tuple[int, ...], dtype: np.dtype, padded: bool) -> np.ndarray:
    """Ones; with `padded`, the last quarter of the sequence masked out, as padding would be."""
    mask = np.ones(shape, dtype)
    if padded and len(shape) >= 2 and shape[-1] >= 4:
        mask[..., shape[-1] - shape[-1] // 4 :] = 0
    return mask


def model_inputs(model: ir.Model) -> dict[str, ir.Value]:
    graph = model.graph
    return {str(v.name): v for v in graph.inputs if v.name not in graph.initializers}


def input_names(model: ir.Model) -> list[str]:
    """The names a caller feeds, in the graph's order: a graph input that is also an
    initializer is a weight with a default, not a feed."""
    graph = model.graph
    return [v.name for v in graph.inputs if v.name and v.name not in graph.initializers]


def feed_dims(model: ir.Model, feeds: dict[str, np.ndarray]) -> dict[str, int]:
    """The value these feeds give every symbolic input dim of `model`."""
    dims: dict[str, int] = {}
    for value in model.graph.inputs:
        if value.name not in feeds or value.shape is None:
            continue
        for dim, size in zip(value.shape, np.shape(feeds[value.name]), strict=False):
            if not isinstance(dim, int) and dim.value:
                dims[str(dim.value)] = int(size)
    return dims


def named_dims(value: ir.Value) -> list[tuple[int, str]]:
    """(axis, name) of the value's symbolic dims."""
    return [
        (axis, str(dim.value))
        for axis, dim in enumerate(value.shape or [])
        if not isinstance(dim, int) and dim.value
    ]


def bind_dims(
    model: ir.Model, dims: dict[str, int], shapes: dict[str, tuple[int, ...]] | None
) -> dict[str, int]:
    """Every named dim of the inputs bound to one value. `--shape INPUT=2x32` binds the dims
    that input names (batch=2, seq=32) for every input sharing them; `--shape seq=32` binds a
    dim by its name; a name nothing binds gets the largest of the inputs' guesses for it (a
    decoder's `memory[batch, src_len, 256]` and `src_mask[batch, src_len]` see one src_len)."""
    inputs, bound = model_inputs(model), dict(dims)
    every = {name for value in inputs.values() for _, name in named_dims(value)}
    for key, shape in (shapes or {}).items():
        if key in inputs:
            value = inputs[key]
            if value.shape is not None and len(value.shape) == len(shape):
                bound |= {name: shape[axis] for axis, name in named_dims(value)}
        elif key in every and len(shape) == 1:
            bound[key] = shape[0]
        elif key in every:
            raise KilnError(f"--shape {key}=...: '{key}' is a dim; give one size, e.g. {key}=32.")
        else:
            raise KilnError(
                f"--shape names '{key}', which is neither an input of the model nor one of its "
                f"dims; inputs: {', '.join(inputs)}; dims: {', '.join(sorted(every)) or 'none'}."
            )
    guesses: dict[str, int] = {}
    for value in inputs.values():
        for axis, name in named_dims(value):
            if name not in bound:
                guesses[name] = max(guesses.get(name, 0), _guess_dim(value, axis))
    return bound | guesses


def synthesize(
    model: ir.Model,
    dims: dict[str, int] | None = None,
    seed: int = 0,
    shapes: dict[str, tuple[int, ...]] | None = None,
    scalars: dict[str, float] | None = None,
) -> dict[str, np.ndarray]:
    """One set of plausible inputs for every graph input that is not an initializer; a named
    dim has one value across all inputs (see `bind_dims`); `scalars` fills inputs with one
    value (a sample rate found by `kiln.ir.ladder`)."""
    dims = bind_dims(model, {**default_dims(model), **(dims or {})}, shapes)
    shapes = {k: v for k, v in (shapes or {}).items() if k in model_inputs(model)}
    rng = np.random.default_rng(seed)
    feeds: dict[str, np.ndarray] = {}
    for value in model.graph.inputs:
        if value.name in model.graph.initializers:
            continue
        shape = input_shape(value, dims, shapes)
        dtype = value.dtype.numpy() if value.dtype is not None else np.dtype(np.float32)
        _check_size(value.name, shape, dtype)
        name = (value.name or "").lower()
        if np.issubdtype(dtype, np.integer):
            if name in SAMPLE_RATE_NAMES and int(np.prod(shape)) == 1:
                feeds[value.name] = np.full(shape, SAMPLE_RATES[0], dtype)
            elif is_mask_input(name):
                feeds[value.name] = _padding_mask(shape, dtype, padded=seed % 2 == 1)
            elif "type" in name or "segment" in name:
                feeds[value.name] = np.zeros(shape, dtype)
            else:
                high = _vocab_size(value) or 100
                feeds[value.name] = rng.integers(0, high, size=shape).astype(dtype)
        elif dtype == np.bool_:
            feeds[value.name] = np.ones(shape, dtype)
        else:
            feeds[value.name] = rng.random(shape, dtype=np.float32).astype(dtype)
    for name, fill in (scalars or {}).items():
        feeds[name] = np.full(feeds[name].shape, fill, feeds[name].dtype)
    return feeds


def _check_size(name: str | None, shape: tuple[int, ...], dtype: np.dtype) -> None:
    """Refuse to synthesize an input larger than a quarter of this machine's memory (a
    --shape or a guessed dim far too big) before numpy tries and the machine swaps."""
    import psutil

    size = int(np.prod(shape, dtype=object)) * max(dtype.itemsize, 1)
    limit = psutil.virtual_memory().total // 4
    if size > limit:
        raise KilnError(
            f"input '{name}' of shape {'x'.join(map(str, shape))} would take "
            f"{size / 2**30:.1f} GiB, more than a quarter of this machine's memory; give smaller "
            "dims with --shape INPUT=D0xD1x... or real inputs with --inputs."
        )


def read_inputs(path: str, model: ir.Model) -> dict[str, np.ndarray]:
    """Read an .npz of inputs and check names, dtypes and ranks against the model (string
    inputs as numpy text arrays: see the module docstring)."""
    file = Path(path)
    if not file.is_file():
        raise KilnError(f"{path}: no such inputs file. Give an .npz with one array per input.")
    if not zipfile.is_zipfile(file):
        raise KilnError(
            f"{path}: not an .npz file. Save the inputs with numpy.savez(path, NAME=array, ...), "
            "one array per model input."
        )
    feeds = _load_npz(file, path)
    check_feeds(model, feeds, where=path)
    return feeds


def read_calibration(path: str, model: ir.Model) -> list[dict[str, np.ndarray]]:
    """Calibration samples from an .npz or a directory of them (sorted by name). In a file,
    arrays with one more dim than the model's input are stacks: the first axis indexes the
    samples; otherwise the file is one sample."""
    where = Path(path)
    if where.is_dir():
        files = sorted(where.glob("*.npz"))
        if not files:
            raise KilnError(f"{path}: no .npz files in this calibration directory.")
    elif where.is_file():
        files = [where]
    else:
        raise KilnError(f"{path}: no such calibration file or directory.")
    ranks = {v.name: len(v.shape) for v in model.graph.inputs if v.shape is not None}
    samples: list[dict[str, np.ndarray]] = []
    for file in files:
        arrays = _read_npz(file)
        stacked = [k for k, a in arrays.items() if k in ranks and a.ndim == ranks[k] + 1]
        if stacked and len(stacked) != len(arrays):
            raise KilnError(
                f"{file}: some arrays are stacks of samples ({stacked[0]}) and some are not; "
                "stack every input the same way."
            )
        count = len(next(iter(arrays.values()))) if stacked else 1
        for i in range(count):
            sample = {k: a[i] for k, a in arrays.items()} if stacked else arrays
            check_feeds(model, sample, where=str(file))
            samples.append(sample)
    return samples


def _read_npz(file: Path) -> dict[str, np.ndarray]:
    if not zipfile.is_zipfile(file):
        raise KilnError(f"{file}: not an .npz file. Save samples with numpy.savez.")
    return _load_npz(file, str(file))


def _load_npz(file: Path, where: str) -> dict[str, np.ndarray]:
    """Every array of an .npz file, never unpickled (see the module docstring)."""
    key = ""
    try:
        with np.load(file, allow_pickle=False) as data:
            arrays = {}
            for key in data.files:
                arrays[key] = data[key]
            return arrays
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "allow_pickle" in reason:
            raise KilnError(
                f"{where}: array '{key}' is a pickled object array, which Kiln does not load. "
                "Save strings as a numpy text array, e.g. np.array(texts, dtype=str), and "
                "other inputs with their numeric dtype."
            ) from None
        raise KilnError(f"{where}: cannot read the .npz file ({reason}).") from None


def check_feeds(model: ir.Model, feeds: dict[str, np.ndarray], where: str = "inputs") -> None:
    """Raise KilnError naming the first input that is unknown, missing, or of the wrong dtype
    or shape. Text arrays ('<U..', or UTF-8 'S..') given for string inputs are replaced, in
    `feeds`, by the object arrays engines take."""
    expected = [v for v in model.graph.inputs if v.name not in model.graph.initializers]
    names = {v.name for v in expected}
    unknown = sorted(set(feeds) - names)
    if unknown:
        raise KilnError(
            f"{where}: unknown input '{unknown[0]}'; the model's inputs are {sorted(names)}. "
            "Name each array after a model input."
        )
    for value in expected:
        if value.name not in feeds:
            raise KilnError(
                f"{where}: missing input '{value.name}' (expected {describe(value)}). "
                "Give one array per model input."
            )
        array = np.asarray(feeds[value.name])
        if value.dtype == ir.DataType.STRING and array.dtype.kind in "US":
            array = feeds[value.name] = _as_strings(array, f"{where}: input '{value.name}'")
        if value.dtype is not None and array.dtype != value.dtype.numpy():
            want = value.dtype.numpy().name
            raise KilnError(
                f"{where}: input '{value.name}' has dtype {array.dtype}, expected "
                f"{describe(value)}. Convert it with .astype('{want}')."
            )
        if value.shape is not None and not _fits(array.shape, value.shape):
            raise KilnError(
                f"{where}: input '{value.name}' has shape {list(array.shape)}, "
                f"expected {describe(value)}. Give an array of that shape."
            )


def _as_strings(array: np.ndarray, what: str) -> np.ndarray:
    """A numpy text array as an object array of str (ONNX Runtime misreads 'S..' arrays)."""
    if array.dtype.kind == "S":
        try:
            array = np.char.decode(array, "utf-8")
        except UnicodeDecodeError as exc:
            raise KilnError(
                f"{what} holds bytes that are not UTF-8 text ({exc.reason}); ONNX strings are "
                "UTF-8. Save the strings as a numpy text array, e.g. np.array(texts, dtype=str)."
            ) from None
    return array.astype(object)


def _fits(shape: tuple[int, ...], expected: ir.Shape) -> bool:
    if len(shape) != len(expected):
        return False
    # Some exporters write -1 for a dynamic dim.
    return all(
        not isinstance(w, int) or w < 0 or g == w for g, w in zip(shape, expected, strict=True)
    )


def misfit_shape(model: ir.Model, shapes: dict[str, tuple[int, ...]] | None) -> str | None:
    """The first --shape of an input that its declared shape refuses (another number of dims,
    or another size where the model fixes one), said as an error; None when all fit. An
    engine's own words for this name neither the flag nor the shape to give."""
    inputs = model_inputs(model)
    for name, shape in (shapes or {}).items():
        value = inputs.get(name)
        if value is None or value.shape is None or _fits(shape, value.shape):
            continue
        declared = list(value.shape)
        if len(shape) != len(declared):
            why = f"it has {len(declared)} dims, the --shape {len(shape)}"
            example = input_shape(value, default_dims(model))
        else:
            fixed = [isinstance(w, int) and w >= 0 for w in declared]
            axis = next(i for i, f in enumerate(fixed) if f and shape[i] != declared[i])
            why = f"its dim {axis} is fixed at {declared[axis]}, the --shape gives {shape[axis]}"
            example = tuple(w if f else g for g, w, f in zip(shape, declared, fixed, strict=True))
        return (
            f"--shape {name}={'x'.join(map(str, shape))} does not fit input '{name}', which the "
            f"model declares as {describe(value)}: {why}. Give its shape in that form, e.g. "
            f"--shape {name}={'x'.join(map(str, example))}."
        )
    return None


def describe(value: ir.Value) -> str:
    dtype = value.dtype.numpy().name if value.dtype is not None else "?"
    dims = [
        d if isinstance(d, int) and d >= 0 else str(getattr(d, "value", None) or "?")
        for d in (value.shape or [])
    ]
    return f"{dtype}{dims}"
