"""Graph passes and the pipeline that runs them."""

from kiln.passes.base import KilnPass
from kiln.passes.pipeline import (
    PassCrashed,
    PassReport,
    PassSpec,
    default_pipeline,
    format_pipeline,
    run_pipeline,
)

__all__ = [
    "KilnPass",
    "PassCrashed",
    "PassReport",
    "PassSpec",
    "default_pipeline",
    "format_pipeline",
    "run_pipeline",
]
