"""PyTorch in: a module or a saved torch.export program becomes an ONNX model with module paths and source lines kept for provenance."""
