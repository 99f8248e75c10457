"""What a pipeline is judged on: its data set and its metric.

`--data DIR` hands the function each file's path in turn (sorted by name); `MODULE:FUNCTION`
returns an iterable of inputs. The metric is `metric(references, outputs) -> float` over the
whole data set, higher is better, the references being the pipeline's own fp32 results;
`exact`, the share of inputs whose result is equal, is built in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kiln.errors import KilnError
from kiln.pipeline.function import load_function, user_error

Metric = Callable[[Sequence[Any], Sequence[Any]], float]


def load_data(data: str | Path | Sequence[Any]) -> list[Any]:
    """The inputs: a directory's files (paths, sorted), a `module:function`'s iterable, or a
    sequence given in Python. An empty data set is refused."""
    if isinstance(data, str | Path) and Path(data).is_dir():
        inputs: list[Any] = [str(p) for p in sorted(Path(data).iterdir()) if p.is_file()]
        where = f"--data {data}"
    elif isinstance(data, str | Path) and ":" not in str(data):
        raise KilnError(f"--data {data}: no such directory; give a directory of inputs or "
                        "MODULE:FUNCTION returning them.")  # fmt: skip
    elif isinstance(data, str):
        maker = load_function(data)
        try:
            inputs = list(maker())
        except Exception as exc:
            raise KilnError(f"--data {data} failed: {user_error(exc)}") from None
        where = f"--data {data}"
    else:
        inputs, where = list(data), "the data given"
    if not inputs:
        raise KilnError(f"{where} holds no inputs: the pipeline needs at least one to record.")
    return inputs


def exact(references: Sequence[Any], outputs: Sequence[Any]) -> float:
    """The share of inputs whose result equals the reference's (arrays compared by value)."""
    same = sum(_equal(r, o) for r, o in zip(references, outputs, strict=True))
    return same / len(references)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(np.asarray(a), np.asarray(b)))
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return bool(a == b)


METRICS: dict[str, Metric] = {"exact": exact}


def load_metric(metric: str | Metric) -> tuple[str, Metric]:
    """The metric by name (`exact`), `module:function`, or a callable; its name and a version
    of it that turns a raise or a non-number into one line (KilnError)."""
    if callable(metric):
        name, function = getattr(metric, "__name__", "metric"), metric
    elif metric in METRICS:
        name, function = metric, METRICS[metric]
    elif ":" in metric:
        name, function = metric, load_function(metric)
    else:
        raise KilnError(
            f"--metric {metric}: use exact or MODULE:FUNCTION (metric(references, outputs) "
            "-> float, higher is better)."
        )

    def checked(references: Sequence[Any], outputs: Sequence[Any]) -> float:
        try:
            value = function(references, outputs)
        except Exception as exc:
            raise KilnError(f"--metric {name} failed: {user_error(exc)}") from None
        if isinstance(value, bool) or not isinstance(value, int | float | np.floating):
            raise KilnError(
                f"--metric {name} returned {type(value).__name__}, not a number "
                "(metric(references, outputs) -> float, higher is better)."
            )
        if not math.isfinite(float(value)):
            raise KilnError(f"--metric {name} returned {value}: it must be a finite number.")
        return float(value)

    return name, checked
