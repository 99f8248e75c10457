"""Artifacts written for the engines users run at scale: a Triton model repository entry,
for Triton's own ONNX Runtime or OpenVINO backend (the engine settings Kiln chose, in the
config.pbtxt fields those backends document) or for Kiln's runtime in Triton's Python backend;
and the KServe files that serve that repository, sized from one measured replica.

Modules: `config` (the ModelConfig of an artifact), `pbtxt` (its config.pbtxt text),
`triton` (the repository layout, written atomically), `python_model` (the model.py Triton
runs; it runs only there), `triton_pipeline` and `python_pipeline_model` (the same for a
pipeline artifact, which only Kiln's runtime runs), `kserve` (the InferenceService,
ServingRuntime and Dockerfile), `wheel` (the wheel of this Kiln that Dockerfile installs),
`measure` (one replica's memory, and the requests/s Kiln's runtime answers in-process, in a
process of its own). The verb is `kiln.cli.export`.
"""

from kiln.deploy.kserve import KServeExport, export_kserve
from kiln.deploy.triton import TritonExport, export_triton

__all__ = ["KServeExport", "TritonExport", "export_kserve", "export_triton"]
