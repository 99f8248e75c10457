"""Artifacts written for the engines users run at scale: a Triton model repository entry,
for Triton's own ONNX Runtime or OpenVINO backend (the engine settings Kiln chose, in the
config.pbtxt fields those backends document) or for Kiln's runtime in Triton's Python backend.

Modules: `config` (the ModelConfig of an artifact), `pbtxt` (its config.pbtxt text),
`triton` (the repository layout, written atomically), `python_model` (the model.py Triton
runs; it runs only there). The verb is `kiln.cli.export`.
"""

from kiln.deploy.triton import TritonExport, export_triton

__all__ = ["TritonExport", "export_triton"]
