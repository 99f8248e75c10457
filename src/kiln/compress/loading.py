"""`module:function` references from the command line (a model factory, a dataset loader, a
student), and calling them: what they need or return that Kiln cannot use is the user's
mistake, reported as one line naming the function."""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

from kiln.errors import KilnError, a_type


def load_callable(spec: str, what: str) -> Callable[[], Any]:
    """The function `spec` names (`package.module:function`), importable from the current
    directory too; KilnError naming the spec when it is not there."""
    module_name, _, name = spec.partition(":")
    if not module_name or not name:
        raise KilnError(f"{what} '{spec}': expected module:function, e.g. mymodels:make_cnn.")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # a user's own module beside them
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise KilnError(f"{what} '{spec}': cannot import {module_name} ({exc}).") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise KilnError(f"{what} '{spec}': {module_name} has no function {name}.")
    return function


def call(function: Any, what: str, expected: type, described: str) -> Any:
    """`function()`, checked to be an `expected` (`described` says what that is); KilnError
    naming the function when it is not callable, needs arguments, raises, or returns
    something else."""
    name = spec_of(function)
    if not callable(function):
        raise KilnError(f"{what} is {a_type(function)}; expected {described} or a "
                        "function that returns one.")  # fmt: skip
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):  # a builtin without one: just call it
        signature = None
    if signature is not None:
        try:
            signature.bind()
        except TypeError:
            raise KilnError(
                f"{what} {name}({', '.join(signature.parameters)}) needs arguments; Kiln "
                f"calls it with none and expects {described}. Give defaults, or wrap it in a "
                "function without parameters."
            ) from None
    try:
        made = function()
    except KilnError:
        raise
    except Exception as exc:  # the user's code failed: where, and why, in one line
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        first = (str(exc).strip().splitlines() or [""])[0]
        raise KilnError(
            f"{what} {name} raised {type(exc).__name__}: {first} (at {frame.filename}:"
            f"{frame.lineno}); expected it to return {described}."
        ) from None
    if not isinstance(made, expected):
        raise KilnError(f"{what} {name} returned {a_type(made)}; expected {described}.")
    return made


def spec_of(function: Any) -> str:
    """`module:name`, as the command line names a function."""
    module = getattr(function, "__module__", None)
    name = getattr(function, "__qualname__", None) or type(function).__name__
    return f"{module}:{name}" if module else name
