"""Debugging a compiled model: layer-wise comparison of two versions and the first layer where
they diverge (`kiln compare`), with node data for Model Explorer."""

from kiln.debug.compare import Comparison, LayerBudget, compare, first_divergence
from kiln.debug.sides import Side, load_side

__all__ = ["Comparison", "LayerBudget", "Side", "compare", "first_divergence", "load_side"]
