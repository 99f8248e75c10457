"""The pipeline function: the user's own Python over named models, found by MODULE:FUNCTION and
checked against the models given before any work is done.

A pipeline function takes one input (whatever the service receives: a path, bytes, an array)
and its models as keyword-only arguments that behave as ONNX Runtime sessions:

    def read_text(image, *, det, cls, rec): ...

What it raises is the user's: reported as one line naming the place in their file.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
import sysconfig
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from kiln.errors import KilnError

PipelineFunction = Callable[..., Any]

_KILN = os.path.join(str(Path(__file__).resolve().parents[1]), "")
_LIBRARIES = tuple(
    os.path.join(os.path.realpath(path), "")
    for path in (
        _KILN,
        *(sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")),
    )
)


def load_function(spec: str) -> PipelineFunction:
    """The function `spec` names: `module:function` (importable here) or `path/to/file.py:function`.
    One line and KilnError for a spec without both parts, a module that cannot be found or
    fails to import (the place in the user's file), or a name that is not a function there."""
    module_name, sep, name = spec.rpartition(":")
    if not sep or not module_name or not name.isidentifier():
        raise KilnError(
            f"{spec!r}: give the pipeline as MODULE:FUNCTION (a module importable here, or a "
            "path to a .py file, then the function's name), e.g. ocr.py:read_text."
        )
    module = _import(module_name, spec)
    function = getattr(module, name, None)
    if not callable(function):
        found = sorted(n for n, v in vars(module).items() if inspect.isfunction(v))
        raise KilnError(
            f"{spec}: {module_name} has no function {name!r}"
            + (f" (its functions: {', '.join(found)})." if found else ".")
        )
    return function


def _import(module_name: str, spec: str) -> Any:
    path = Path(module_name)
    try:
        if path.suffix == ".py" or os.sep in module_name:
            if not path.is_file():
                raise KilnError(f"{spec}: no file {path}.")
            return _import_file(path)
        return importlib.import_module(module_name)
    except KilnError:
        raise
    except ModuleNotFoundError as exc:
        if exc.name == module_name.split(".")[0]:
            raise KilnError(
                f"{spec}: no module {module_name!r} here (give a path to its .py file, or run "
                "from the directory that holds it)."
            ) from None
        raise KilnError(f"{spec}: importing {module_name} failed: {user_error(exc)}") from None
    except Exception as exc:  # the user's module raised while it was imported
        raise KilnError(f"{spec}: importing {module_name} failed: {user_error(exc)}") from None


def _import_file(path: Path) -> Any:
    """The module in `path`, imported under a name of its own (its stem), with its directory
    on sys.path so that its own imports of neighbouring files work, as `python path` would."""
    name = path.stem
    loaded = sys.modules.get(name)
    if loaded is not None:
        if Path(getattr(loaded, "__file__", "") or "").resolve() == path.resolve():
            return loaded
        # Another module of that name (a pipeline artifact's copy of a file imported from
        # elsewhere): this one gets a name of its own rather than replacing it.
        name = f"{name}__{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:8]}"
        if name in sys.modules:
            return sys.modules[name]
    directory = str(path.resolve().parent)
    if directory not in sys.path:
        sys.path.insert(0, directory)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None  # a .py file always has one
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def model_parameters(function: PipelineFunction) -> tuple[list[str], list[str]]:
    """The function's keyword-only parameters: those it requires, those with a default."""
    required, optional = [], []
    for parameter in inspect.signature(function).parameters.values():
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY:
            (optional if parameter.default is not inspect.Parameter.empty else required).append(
                parameter.name
            )
    return required, optional


def check_models(function: PipelineFunction, names: Sequence[str], spec: str = "") -> None:
    """KilnError unless `function` takes one input and exactly the models `names`."""
    where = spec or getattr(function, "__qualname__", repr(function))
    parameters = inspect.signature(function).parameters.values()
    kinds = {p.kind for p in parameters}
    positional = [
        p for p in parameters
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    ]  # fmt: skip
    if len(positional) != 1 and inspect.Parameter.VAR_POSITIONAL not in kinds:
        raise KilnError(
            f"{where}: a pipeline function takes its one input first and its models as "
            f"keyword-only arguments (def f(x, *, {', '.join(names) or 'model'})); it takes "
            f"{len(positional)} positional arguments."
        )
    required, optional = model_parameters(function)
    missing = [name for name in required if name not in names]
    if missing:
        raise KilnError(
            f"{where} takes the models {', '.join(required)}; --model gives none for "
            f"{', '.join(missing)} (give --model {missing[0]}=PATH)."
        )
    takes_any = inspect.Parameter.VAR_KEYWORD in kinds
    unknown = [name for name in names if name not in required + optional]
    if unknown and not takes_any:
        raise KilnError(
            f"{where} takes no model named {', '.join(unknown)} (its models: "
            f"{', '.join(required + optional) or 'none'})."
        )


def parse_models(specs: Sequence[str]) -> dict[str, str]:
    """`--model NAME=PATH` given once per model: {name: path}. One line for a spec without
    `=`, a name that is not an identifier or a name given twice."""
    models: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not path:
            raise KilnError(f"--model {spec}: give NAME=PATH, e.g. --model det=det.onnx.")
        if not name.isidentifier():
            raise KilnError(f"--model {spec}: {name!r} is not a Python name for the argument.")
        if name in models:
            raise KilnError(f"--model {name} is given twice ({models[name]} and {path}).")
        models[name] = path
    return models


def source_hash(function: PipelineFunction) -> str:
    """SHA-256 of the source file that defines `function`: what a pipeline artifact was
    compiled from, so that a changed function is noticed."""
    path = inspect.getsourcefile(function)
    data = Path(path).read_bytes() if path else inspect.getsource(function).encode()
    return hashlib.sha256(data).hexdigest()


def user_error(exc: BaseException) -> str:
    """`exc` as one line with the place in the user's code where it was raised: the innermost
    frame outside Kiln, Python's library and installed packages."""
    place = ""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        file = os.path.realpath(frame.filename)
        if not file.startswith(_LIBRARIES) and not frame.filename.startswith("<"):
            place = f" (at {frame.filename}:{frame.lineno})"
            break
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}{place}".replace(": (", " (")


def described(value: Any) -> str:
    """An input named for a message: a path as it is, anything else by type and size."""
    if isinstance(value, str | os.PathLike):
        return str(value)
    shape = getattr(value, "shape", None)
    if shape is not None:
        return f"a {type(value).__name__} of shape {tuple(shape)}"
    if isinstance(value, bytes | bytearray):
        return f"{len(value)} bytes"
    if isinstance(value, int | float) and len(repr(value)) <= 20:
        return repr(value)
    return type(value).__name__


def stage_failed(name: str, exc: BaseException, index: int, value: Any) -> KilnError:
    why = str(exc) if isinstance(exc, KilnError) else user_error(exc)
    return KilnError(f"model {name!r} failed on input {index} ({described(value)}): {why}")


def feeds_problem(feeds: Mapping[str, Any]) -> str | None:
    """Why `feeds` cannot be a model call's feeds (a mapping of names to arrays), or None."""
    if not isinstance(feeds, Mapping):
        return f"feeds must be a dict of input name → array, not {type(feeds).__name__}"
    return None
