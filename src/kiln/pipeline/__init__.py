"""Pipelines: the user's own Python function over named models, run and measured as one.

A pipeline is `def f(x, *, det, rec): ...` — its models arrive as keyword arguments that
behave as ONNX Runtime sessions. `record` runs it with each model as it is and keeps every
model call (the stages' real feeds and shapes); `Pipeline` runs it on one input or on many
streams with each model's calls pooled across streams into batches.
"""

from kiln.pipeline.compile import compile_pipeline
from kiln.pipeline.function import check_models, load_function, parse_models
from kiln.pipeline.recording import Recording, record
from kiln.pipeline.runtime import Pipeline
from kiln.pipeline.streams import run_streams

__all__ = [
    "Pipeline", "Recording", "check_models", "compile_pipeline", "load_function",
    "parse_models", "record", "run_streams",
]  # fmt: skip
