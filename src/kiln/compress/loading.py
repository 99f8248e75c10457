"""`module:function` references from the command line: a model factory, a dataset loader."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from kiln.errors import KilnError


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
