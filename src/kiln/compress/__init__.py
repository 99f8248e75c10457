"""Compression under the accuracy guard: quantization-aware training, structured pruning
and distillation (PyTorch), each ending in a verified Kiln artifact."""
