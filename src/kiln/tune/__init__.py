"""`kiln.tune`: search every decision Kiln makes (Optuna), measured honestly against the
incumbent; the strategy library that remembers across models (see DESIGN.md)."""

from kiln.tune.objectives import OBJECTIVES, parse_constraint, parse_objectives
from kiln.tune.study import Plan, TuneResult, plan_for, tune

__all__ = ["OBJECTIVES", "Plan", "TuneResult", "parse_constraint", "parse_objectives",
           "plan_for", "tune"]  # fmt: skip
