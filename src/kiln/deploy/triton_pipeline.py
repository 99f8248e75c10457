"""A pipeline artifact as an entry of a Triton model repository (`export_triton` routes it here).

    REPO/NAME/config.pbtxt               Triton's Python backend, the pipeline's one model
    REPO/NAME/VERSION/model.py           Kiln's pipeline runtime in Triton's Python backend ...
    REPO/NAME/VERSION/artifact.kiln/     ... serving this copy of the pipeline artifact

The model is the one `kiln serve` serves a pipeline as (kiln.pipeline.served): BYTES `input`,
each element one query; BYTES `output`, each query's result as JSON; both lead with the batch
dim, so Triton's dynamic batcher merges requests and the model runs them as streams together.
Only Kiln's runtime runs a pipeline: its glue is the user's Python over several stages, which
no Triton backend runs as one graph.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from kiln import __version__
from kiln.artifact import read_artifact
from kiln.artifact.parts import is_partitioned
from kiln.artifact.store import read_partitioned
from kiln.deploy.config import DEFAULT_MAX_BATCH, KILN
from kiln.errors import KilnError
from kiln.pipeline.pipeline_artifact import read_pipeline
from kiln.pipeline.served import PipelineSession
from kiln.serve.protocol import model_config

_PYTHON_MODEL = Path(__file__).with_name("python_pipeline_model.py")
ARTIFACT_DIR = "artifact.kiln"  # as python_pipeline_model.ARTIFACT, which cannot import Kiln


def check_pipeline(artifact: str | Path, runtime: str) -> None:
    """Refuse, before anything is written, a pipeline that cannot be exported: for a runtime
    other than Kiln's, or whose function or stages cannot be opened."""
    if runtime != KILN:
        raise KilnError(
            f"{artifact} is a pipeline artifact: its glue is Python over several stages, which "
            "only Kiln's runtime runs (Triton's own backends run one graph); pass --runtime kiln."
        )
    _, stages, _ = read_pipeline(artifact)  # imports the function's module: it must load
    for stage in stages.values():  # a damaged stage is refused here, not in Triton
        read_partitioned(stage) if is_partitioned(stage) else read_artifact(stage)


def pipeline_config(name: str) -> dict[str, Any]:
    """Triton's ModelConfig of the pipeline served as model `name`: kiln serve's batcher
    defaults (up to 16 requests, no delay), Python backend on the CPU."""
    return model_config(
        name, PipelineSession.inputs, PipelineSession.outputs, platform="", backend="python",
        kind="KIND_CPU", max_batch_size=DEFAULT_MAX_BATCH, max_delay_s=0.0,
    )  # fmt: skip


def pipeline_header(artifact: str | Path) -> list[str]:
    return [f"Written by kiln export (kiln {__version__}) from {Path(artifact).resolve()}: "
            "Triton's python backend, running Kiln's pipeline runtime."]  # fmt: skip


def fill_pipeline(into: Path, artifact: str | Path) -> None:
    """The version directory's files: model.py, and the whole artifact (the function's module
    file and the stages beside it), without caches of compiled Python."""
    into.mkdir(exist_ok=True)
    shutil.copyfile(_PYTHON_MODEL, into / "model.py")
    shutil.copytree(artifact, into / ARTIFACT_DIR,
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
