"""PyTorch in: a module or a saved torch.export program becomes an ONNX model with module paths
and source lines kept for provenance.

`import kiln.frontend` does not import torch: only a call that needs it does, and without
PyTorch installed it says how to get it.
"""

from kiln.frontend.export import to_onnx
from kiln.frontend.load import is_torch_model, load_pt2, load_torch

__all__ = ["is_torch_model", "load_pt2", "load_torch", "to_onnx"]
