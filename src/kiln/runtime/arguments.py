"""`run(output_names, feeds)`'s arguments as ONNX Runtime users pass them, checked and put in
the form the engines take; every refusal says what was expected."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx_ir as ir

from kiln.errors import KilnError, a_type
from kiln.ir.inputs import check_feeds
from kiln.runtime.metadata import graph_inputs

Feeds = dict[str, np.ndarray]


def output_list(output_names: Any, outputs: list[str], where: str) -> list[str]:
    """The outputs asked for, in order; None or empty: all of them."""
    if isinstance(output_names, str):  # would otherwise be read one character at a time
        raise KilnError(
            f"{where}: output_names must be a list (or None for every output), not the string "
            f"{output_names!r}; pass [{output_names!r}]."
        )
    if not isinstance(output_names, list | tuple | None):
        raise KilnError(
            f"{where}: output_names must be a list of the model's outputs {outputs} or None, "
            f"got {output_names!r}."
        )
    unknown = set(output_names or []) - set(outputs)
    if unknown:
        raise KilnError(
            f"unknown output '{sorted(unknown)[0]}'; the model's outputs are {outputs}."
        )
    return list(output_names) if output_names else list(outputs)


def checked_feeds(feeds: Any, model: ir.Model, where: str) -> Feeds:
    """The feeds, checked against the model's inputs, with numpy text ('<U..', what numpy
    makes from Python strings) as the object arrays engines take for string inputs."""
    inputs = graph_inputs(model)
    if not isinstance(feeds, Mapping):
        names = [v.name for v in inputs]
        got = "None" if feeds is None else a_type(feeds)
        raise KilnError(
            f"{where}: feeds must be a dict of input name -> numpy array, one per input "
            f"{names}, e.g. {{{names[0]!r}: array}}; got {got}."
        )
    strings = {v.name for v in inputs if v.dtype == ir.DataType.STRING}
    feeds = {name: _as_text(value) if name in strings else value for name, value in feeds.items()}
    check_feeds(model, feeds, where=where)
    return feeds


def _as_text(value: Any) -> Any:
    if isinstance(value, np.ndarray) and value.dtype.kind == "U":
        return value.astype(object)
    return value
