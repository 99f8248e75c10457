"""`kiln.split`: one model cut between an edge device and a server, the cut chosen from measured
per-node times and the link's bandwidth, the boundary encoded under the accuracy budget (see
plan.py). cuts.py finds where a model may be cut and predicts each cut's cost, codec.py encodes
the boundary, times.py measures the per-node times the prediction reads.

`kiln.split(...)` calls `split` (plan.py): the package itself is callable, as importing any of
its modules makes the package, not the function, the `kiln.split` attribute.
"""

from __future__ import annotations

import inspect
import sys
import types
from typing import Any

from kiln.split.cuts import SplitCut, parse_bandwidth
from kiln.split.plan import SplitResult, split


class _CallableModule(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> SplitResult:
        return split(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
__signature__ = inspect.signature(split)  # what inspect and help show for kiln.split

__all__ = ["SplitCut", "SplitResult", "parse_bandwidth", "split"]
