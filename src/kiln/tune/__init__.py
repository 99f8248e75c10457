"""`kiln.tune`: search every decision Kiln makes (Optuna), measured honestly against the
incumbent; the strategy library that remembers across models; the feedback loop that tunes
a running model from its live traffic (see docs/contributing/architecture.md).

Names load on first use: `kiln.Session(..., feedback=True)` loads kiln.tune.feedback, which
must not pull in Optuna.
"""

from typing import Any

_LAZY = {
    "OBJECTIVES": "kiln.tune.objectives",
    "parse_constraint": "kiln.tune.objectives",
    "parse_objectives": "kiln.tune.objectives",
    "Plan": "kiln.tune.study",
    "TuneResult": "kiln.tune.study",
    "plan_for": "kiln.tune.study",
    "tune": "kiln.tune.study",
    "FeedbackLoop": "kiln.tune.feedback",
    "Strategy": "kiln.tune.feedback",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'kiln.tune' has no attribute '{name}'")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


__all__ = sorted(_LAZY)
