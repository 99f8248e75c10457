"""`kiln export`: an artifact written for the serving engines users run at scale: a Triton
model repository, and the KServe files that serve it."""

from __future__ import annotations

import math
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from kiln.cli.console import JsonOpt, console, emit_json, err, progress
from kiln.errors import KilnError

if TYPE_CHECKING:  # kiln.deploy loads when the verb runs: `kiln --help` stays fast
    from kiln.deploy import KServeExport, TritonExport


ArtifactArg = Annotated[Path, typer.Argument(help="A NAME.kiln artifact directory.")]
TritonOpt = Annotated[
    Path | None,
    typer.Option(
        "--triton",
        help="A Triton model repository to write the model into (created if missing).",
    ),
]
NameOpt = Annotated[
    str | None, typer.Option(help="Model name in the repository (default: the artifact's).")
]
VersionOpt = Annotated[int, typer.Option("--version", help="Model version directory.")]
RuntimeOpt = Annotated[
    str | None,
    typer.Option(
        help="native: Triton's ONNX Runtime or OpenVINO backend with Kiln's engine "
        "settings; kiln: Kiln's runtime (buckets, verified swaps) in Triton's "
        "Python backend, the only one that runs a pipeline artifact. Default: native for a "
        "model, kiln for a pipeline."
    ),
]
KserveOpt = Annotated[
    Path | None,
    typer.Option(
        "--kserve",
        help="Also write KServe's files serving REPO into this directory: "
        "inferenceservice.yaml (and servingruntime.yaml, Dockerfile with --runtime kiln), "
        "with resources and autoscaling from one replica measured here.",
    ),
]
StorageUriOpt = Annotated[
    str | None,
    typer.Option(
        "--storage-uri",
        help="Where KServe finds REPO (s3://, gs://, pvc://, ...; default "
        "pvc://kiln-models/<REPO's name>).",
    ),
]
ImageOpt = Annotated[
    str | None,
    typer.Option(
        help="--kserve with --runtime kiln: the image of the ServingRuntime, built from the "
        "Dockerfile written (default kiln-tritonserver:<kiln version>)."
    ),
]
MeasureSOpt = Annotated[
    float,
    typer.Option("--measure-s", help="--kserve: seconds to serve one replica for its throughput."),
]
ForceOpt = Annotated[
    bool,
    typer.Option(
        help="Replace an existing version directory of the model, its config.pbtxt where "
        "the versions kept there need another (they then run under this one), and "
        "--kserve's files."
    ),
]


def export(
    artifact: ArtifactArg, triton: TritonOpt = None, name: NameOpt = None,
    version: VersionOpt = 1, runtime: RuntimeOpt = None, kserve: KserveOpt = None,
    storage_uri: StorageUriOpt = None, image: ImageOpt = None, measure_s: MeasureSOpt = 3.0,
    force: ForceOpt = False, json_: JsonOpt = False,
) -> None:  # fmt: skip
    """Write ARTIFACT into a Triton model repository: REPO/NAME/config.pbtxt and
    REPO/NAME/VERSION/, ready for `tritonserver --model-repository REPO`; with --kserve,
    the InferenceService that serves REPO on KServe."""
    from kiln.deploy import export_kserve, export_triton
    from kiln.pipeline.pipeline_artifact import is_pipeline

    pipeline = is_pipeline(artifact)
    if pipeline and kserve is not None:
        raise KilnError(
            f"{artifact} is a pipeline artifact: --kserve sizes a replica of one model; "
            "export the pipeline with --triton REPO alone."
        )
    runtime = runtime or ("kiln" if pipeline else "native")
    if triton is None:
        where = " (--kserve serves the repository --triton writes)" if kserve else ""
        raise KilnError(
            f"kiln export needs a destination: --triton REPO (a model repository){where}."
        )
    for flag, given in (("--storage-uri", storage_uri), ("--image", image)):
        if given is not None and kserve is None:
            raise KilnError(f"{flag} goes with --kserve DIR.")
    if kserve is not None:
        with progress() as bar:
            task = bar.add_task(f"exporting {artifact}")

            def say(message: str) -> None:  # the measuring takes seconds: said on one line
                err.print(message, highlight=False, markup=False, soft_wrap=True)
                bar.update(task, description=message)

            served = export_kserve(artifact, triton, kserve, name=name, version=version,
                                   runtime=runtime, storage_uri=storage_uri, image=image,
                                   measure_s=measure_s, force=force, say=say)  # fmt: skip
        if json_:
            emit_json(served.to_json())
            return
        _print_triton(served.triton, python_note=False)  # the Dockerfile installs Kiln
        _print_kserve(served, image_given=image is not None)
        return
    done = export_triton(artifact, triton, name=name, version=version, runtime=runtime,
                         force=force)  # fmt: skip
    if json_:
        emit_json(done.to_json())
        return
    _print_triton(done)


def _print_triton(done: TritonExport, python_note: bool = True) -> None:
    config = done.config
    batching = (f"batches of up to {config['max_batch_size']}" if config["max_batch_size"]
                else "no batching (the model has no batch dim)")  # fmt: skip
    console.print(
        f"wrote {done.version_path} and {done.path / 'config.pbtxt'}: model '{done.name}' on "
        f"Triton's {done.backend} backend, {batching}",
        highlight=False, markup=False, soft_wrap=True,
    )  # fmt: skip
    if done.requires:  # Triton's image pins its engine: the model's needs are said here
        err.print(f"requires: {done.requires}", highlight=False, markup=False, soft_wrap=True)
    for note in done.notes:
        err.print(f"note: {note}", highlight=False, markup=False, soft_wrap=True)
    if done.runtime == "kiln" and python_note:
        err.print(
            "note: Triton runs model.py with the python3 first on its PATH (or the config's "
            "EXECUTION_ENV_PATH): install this Kiln there (--kserve DIR writes a wheel of it "
            "and a Dockerfile that installs it), with numpy<2 where Triton's Python backend "
            "stub is built against numpy 1.x",
            highlight=False, markup=False, soft_wrap=True,
        )  # fmt: skip
    console.print(
        f"serve it: tritonserver --model-repository {shlex.quote(str(done.repository))}",
        highlight=False, markup=False, soft_wrap=True,
    )  # fmt: skip


def _print_kserve(done: KServeExport, image_given: bool) -> None:
    files = ", ".join(p.name for p in done.files)
    on = ("KServe's Triton runtime" if done.image is None
          else f"the ServingRuntime {done.serving_runtime} (image {done.image})")  # fmt: skip
    replica = done.replica
    console.print(
        f"wrote {files} in {done.directory}: InferenceService '{done.service}' on {on}, "
        f"loading model '{done.triton.name}' alone from storageUri {done.storage_uri}; cpu "
        f"{done.cpu} ({done.threads_from}), memory {done.memory_mib}Mi (measured peak "
        f"{math.ceil(replica.peak_mib)} MiB), "
        f"containerConcurrency {done.container_concurrency} ({done.batch_from}), scaleTarget "
        f"{done.scale_target}; Kiln's runtime answered {replica.in_process_rps:.1f} "
        "requests/s in-process (no server or network between: an upper bound on a served "
        "replica)",
        highlight=False, markup=False, soft_wrap=True,
    )  # fmt: skip
    if not done.storage_given:
        err.print(
            f"note: KServe reads the repository from {done.storage_uri}: copy what is in "
            f"{done.triton.repository} there, or pass --storage-uri s3://BUCKET/PATH where you "
            "upload it",
            highlight=False, markup=False, soft_wrap=True,
        )  # fmt: skip
    order = [p for p in done.files if p.suffix == ".yaml"]
    if done.image is not None:
        then = (
            f"as {done.image}"
            if image_given
            else f"then pass --image REGISTRY/NAME:TAG (the ServingRuntime names {done.image})"
        )
        err.print(
            f"note: build the image in {done.directory} (its Dockerfile installs the wheel of "
            f"Kiln beside it) and push it where the cluster pulls from, {then}",
            highlight=False, markup=False, soft_wrap=True,
        )  # fmt: skip
        order.reverse()  # the ServingRuntime before the InferenceService that names it
    console.print(
        "serve it: kubectl apply " + " ".join(f"-f {shlex.quote(str(p))}" for p in order),
        highlight=False, markup=False, soft_wrap=True,
    )  # fmt: skip
