"""Compression under the accuracy guard: quantization-aware training, structured pruning,
distillation (PyTorch), each ending in a verified Kiln artifact.

`kiln.compress.compress(model, data, "out.kiln", method="all")` runs them all on a model and a
dataset (see kiln.compress.api); kiln.compress.data and kiln.compress.models hold the real,
offline digits dataset and the two models the methods are shown on.
"""

from kiln.compress.api import METHODS, Result, Row, compress

__all__ = ["METHODS", "Result", "Row", "compress"]
