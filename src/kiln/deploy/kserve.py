"""`export_kserve`: an artifact's Triton repository entry served by KServe, with the
resources and autoscaling one replica was measured to need.

    DIR/inferenceservice.yaml   the InferenceService: Triton's model format, protocol v2,
                                storageUri = the repository, resources, autoscaling
    DIR/servingruntime.yaml     --runtime kiln: a ServingRuntime of Triton with Kiln ...
    DIR/Dockerfile              ... built from NVIDIA's tritonserver image, installing
    DIR/kiln_ml-VERSION-py3-none-any.whl   a wheel of this Kiln (wheel.py)

Field by field, what KServe's own files say (kserve/kserve):

- config/runtimes/kserve-tritonserver.yaml: the ClusterServingRuntime `kserve-tritonserver`
  supports model format `triton` (version "2") and protocols v2 and grpc-v2, and runs
  `tritonserver --model-store=/mnt/models --grpc-port=9000 --http-port=8080 ...` (KServe
  puts storageUri's files at /mnt/models) in image nvcr.io/nvidia/tritonserver:23.05-py3
  (config/runtimes/kustomization.yaml). It declares no port: Knative's default, 8080 HTTP/1.
  Kiln's ServingRuntime keeps those args, annotations and securityContext; its image is
  built FROM a later tritonserver (KILN_BASE_IMAGE): 23.05's Python 3.10 has no wheels of the
  engine versions Kiln pins, and its Python backend's errors carry no code before 23.09.
- Knative routes one container port, named `http1` or `h2c`; KServe's samples name gRPC's
  9000 `h2c`. Kiln declares HTTP's 8080 as `http1`, the port the args open.
- pkg/apis/serving/v1beta1/component.go: `containerConcurrency` (the hard limit of requests
  in one replica), `scaleMetric` and `scaleTarget`, which KServe writes as Knative's
  `autoscaling.knative.dev/metric` and `/target` (knative utils SetAutoScalingAnnotations).
  They act in Knative (Serverless) mode: the annotation `serving.kserve.io/deploymentMode:
  Serverless` asks for it (newer KServe reads it as `Knative`; its default is Standard).
- Knative's config-autoscaler: `container-concurrency-target-percentage: "70"` — the target
  is 70 % of the limit, so a replica is added before one is full.
- pkg/controller/v1beta1/inferenceservice/utils/utils.go, MergeRuntimeContainers: the
  predictor's `args` follow the runtime's (concatenated, not replaced). Each service gives
  Triton `--model-control-mode=explicit --load-model=NAME`, so a replica of a repository of
  several models loads only its own (Triton's default mode loads every model there).

What Kiln fills in: args = load this model only; cpu = the artifact's engine threads (ONNX
Runtime's intra-op threads, OpenVINO's INFERENCE_NUM_THREADS; 0 = the engine's default, this
machine's physical cores, which a native config.pbtxt then names too, so the engine runs the
threads the limit pays for); memory = the peak resident memory of one replica of this model
(the one it loads) measured in a process of its own (kiln.deploy.measure) × 1.5;
containerConcurrency = the batch Triton gathers (`kiln tune --clients`' max batch, else 16;
1 for a model without a batch dim); scaleTarget = 70 % of it; the requests/s Kiln's runtime
answered in the measuring process (no server, no network: an upper bound on what a served
replica answers) as the annotation kiln.dev/in-process-rps.
"""

from __future__ import annotations

import importlib.metadata as metadata
import math
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kiln import __version__
from kiln.artifact import Manifest
from kiln.artifact.parts import PartsSection
from kiln.deploy.config import (
    ENGINE_DISTRIBUTIONS,
    KILN,
    NATIVE,
    RUNTIMES,
    engine_threads,
    tuned_batcher,
)
from kiln.deploy.measure import Replica, measure_replica
from kiln.deploy.triton import TritonExport, default_name, export_triton, read_source
from kiln.deploy.wheel import RUNTIME_PACKAGES, WHEEL_GLOB, build_wheel, wheel_file
from kiln.errors import KilnError
from kiln.home import output_problem, replace_directory

INFERENCE_SERVICE = "inferenceservice.yaml"
SERVING_RUNTIME = "servingruntime.yaml"
DOCKERFILE = "Dockerfile"
FILES = (INFERENCE_SERVICE, SERVING_RUNTIME, DOCKERFILE)  # and the wheel, named by version

# KServe's Triton runtime, as config/runtimes/kserve-tritonserver.yaml ships it.
TRITON_RUNTIME = "kserve-tritonserver"
TRITON_IMAGE = "nvcr.io/nvidia/tritonserver:23.05-py3"
HTTP_PORT, GRPC_PORT = 8080, 9000
TRITON_ARGS = [
    "tritonserver", "--model-store=/mnt/models", f"--grpc-port={GRPC_PORT}",
    f"--http-port={HTTP_PORT}", "--allow-grpc=true", "--allow-http=true",
]  # fmt: skip
PORT = {"name": "http1", "containerPort": HTTP_PORT, "protocol": "TCP"}
SECURITY_CONTEXT = {
    "runAsUser": 1000, "allowPrivilegeEscalation": False, "privileged": False,
    "runAsNonRoot": True, "capabilities": {"drop": ["ALL"]},
}  # fmt: skip
KILN_RUNTIME = "kiln-tritonserver"
# The image of Kiln's runtime: Triton 26.05 (Python backend errors with codes, 23.09 on) on
# Ubuntu 24.04, whose python3 is CPython 3.12 with glibc 2.39; the amd64 image is the one
# checked (the tests download each requirement's wheel for it).
KILN_BASE_IMAGE = "nvcr.io/nvidia/tritonserver:26.05-py3"
IMAGE_PYTHON = "3.12"
IMAGE_PLATFORMS = tuple(
    [f"manylinux_2_{minor}_x86_64" for minor in range(39, 16, -1)]
    + ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
)  # every manylinux tag glibc 2.39 runs, newest first
# The Python backend's stub in the images Kiln is tested with is built against numpy 1.x.
IMAGE_NUMPY = "numpy<2"
DEFAULT_IMAGE = f"kiln-tritonserver:{__version__}"
TARGET_UTILIZATION = 0.70  # Knative's container-concurrency-target-percentage default
MEMORY_HEADROOM = 1.5
DEFAULT_MEASURE_S = 3.0
DEFAULT_PVC = "kiln-models"
# pkg/controller/v1beta1/inferenceservice/utils/utils.go: SupportedStorageURIPrefixList.
STORAGE_SCHEMES = ("gs", "s3", "pvc", "file", "https", "http", "hdfs", "webhdfs", "oci",
                   "oci+native", "oci+fetch", "hf")  # fmt: skip
# pkg/apis/serving/v1beta1/inference_service_validation.go: IsvcNameFmt.
_SERVICE_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")


@dataclass
class KServeExport:
    """What `export_kserve` wrote and the figures in it."""

    directory: Path
    files: list[Path]
    triton: TritonExport  # the repository entry storageUri serves
    service: str  # the InferenceService's name
    serving_runtime: str  # the ServingRuntime it names
    storage_uri: str
    storage_given: bool  # False: the default PVC, where the repository must be copied
    image: str | None  # --runtime kiln: the image the ServingRuntime runs
    cpu: int  # engine threads: requests and limits
    threads_from: str  # "artifact", "parts" or "physical cores" (left to the engine)
    memory_mib: int  # requests and limits: the measured peak × MEMORY_HEADROOM
    container_concurrency: int
    scale_target: int
    batch_from: str  # "kiln tune", "default" or "no batch dim"
    replica: Replica
    documents: dict[str, Any] = field(default_factory=dict)  # file name → what it holds

    def to_json(self) -> dict[str, Any]:
        return {
            "directory": str(self.directory), "files": [str(p) for p in self.files],
            "triton": self.triton.to_json(), "service": self.service,
            "serving_runtime": self.serving_runtime, "storage_uri": self.storage_uri,
            "storage_given": self.storage_given, "image": self.image, "cpu": self.cpu,
            "threads_from": self.threads_from, "memory_mib": self.memory_mib,
            "container_concurrency": self.container_concurrency,
            "scale_target": self.scale_target, "batch_from": self.batch_from,
            "replica": self.replica.to_json(),
        }  # fmt: skip


def export_kserve(
    artifact: str | Path,
    repository: str | Path,
    directory: str | Path,
    *,
    name: str | None = None,
    version: int = 1,
    runtime: str = NATIVE,
    storage_uri: str | None = None,
    image: str | None = None,
    measure_s: float = DEFAULT_MEASURE_S,
    force: bool = False,
    say: Callable[[str], None] | None = None,
) -> KServeExport:
    """Write `artifact` into the Triton repository `repository` (as `export_triton` does,
    same `name`, `version`, `runtime`, `force`) and, into `directory`, the KServe files that
    serve that repository from `storage_uri` (default pvc://kiln-models/<repository's
    name>): an InferenceService on KServe's Triton runtime (native) or on a ServingRuntime
    of Triton with Kiln, in `image`, and its Dockerfile (kiln). One replica is measured for
    `measure_s` seconds in a process of its own first (`say` tells when). Existing files of
    an export in `directory` are replaced only with `force`. Raises KilnError on bad input,
    having written nothing (or, when the measurement fails, only the repository entry)."""
    say = say or (lambda _: None)
    if runtime not in RUNTIMES:
        raise KilnError(f"unknown runtime '{runtime}'; use {' or '.join(RUNTIMES)}.")
    if not (measure_s > 0 and math.isfinite(measure_s)):
        raise KilnError(f"--measure-s {measure_s:g}: measure for a number of seconds above 0.")
    if image is not None and runtime != KILN:
        raise KilnError("--image names the image of Kiln's runtime: it goes with --runtime kiln.")
    if image is not None and not image.strip():
        raise KilnError("--image '': name the image the ServingRuntime runs.")
    repository, directory = Path(repository), Path(directory)
    storage_given = storage_uri is not None
    storage_uri = storage_uri if storage_given else f"pvc://{DEFAULT_PVC}/{_repo_name(repository)}"
    _check_storage_uri(storage_uri)
    service = service_name(name if name is not None else default_name(artifact))
    _check_directory(directory, force)
    source = read_source(artifact, runtime)
    cpu, threads_from = engine_threads(source.manifest)  # config.pbtxt names the same count
    triton = export_triton(source.path, repository, name=name, version=version,
                           runtime=runtime, force=force)  # fmt: skip
    concurrency, delay_ms, batch_from = _concurrency(source.manifest, triton.config)
    say(
        f"measuring one replica of {source.path.name} for {measure_s:g} s: its peak memory and "
        f"the requests/s Kiln's runtime answers {concurrency} in-process "
        f"client{'s' * (concurrency != 1)}"
    )
    try:
        replica = measure_replica(source.path, clients=concurrency, max_batch=concurrency,
                                  max_delay_ms=delay_ms, seconds=measure_s)  # fmt: skip
    except KilnError as exc:
        raise KilnError(f"{exc} The Triton entry {triton.version_path} was written; nothing "
                        f"was written to {directory}.") from None  # fmt: skip
    done = KServeExport(
        directory=directory, files=[], triton=triton, service=service,
        serving_runtime=KILN_RUNTIME if runtime == KILN else TRITON_RUNTIME,
        storage_uri=storage_uri, storage_given=storage_given,
        image=(image or DEFAULT_IMAGE) if runtime == KILN else None, cpu=cpu,
        threads_from=threads_from, memory_mib=math.ceil(replica.peak_mib * MEMORY_HEADROOM),
        container_concurrency=concurrency, scale_target=target_concurrency(concurrency),
        batch_from=batch_from, replica=replica,
    )  # fmt: skip
    done.documents[INFERENCE_SERVICE] = inference_service(done)
    files: dict[str, str | bytes] = {
        INFERENCE_SERVICE: _yaml(done.documents[INFERENCE_SERVICE], _header(done, source))
    }
    if runtime == KILN:
        done.documents[SERVING_RUNTIME] = serving_runtime(done)
        files[SERVING_RUNTIME] = _yaml(done.documents[SERVING_RUNTIME], _header(done, source))
        files[DOCKERFILE] = dockerfile(source.manifest)
        files[wheel_file()] = build_wheel()  # the Dockerfile's build context
    _install(directory, files)
    done.files = [directory / file for file in files]
    return done


# ---------------------------------------------------------------- the figures


def target_concurrency(container_concurrency: int) -> int:
    """Knative's target: TARGET_UTILIZATION of the limit, at least one request."""
    return max(1, round(container_concurrency * TARGET_UTILIZATION))


def _concurrency(manifest: Manifest, config: dict[str, Any]) -> tuple[int, float, str]:
    """(requests one replica serves at once, the batcher's delay ms, where from): the batch
    Triton's dynamic batcher gathers (config.py's max_batch_size), or one at a time for a
    model without a batch dim."""
    max_batch, delay_ms = tuned_batcher(manifest)
    if not config.get("max_batch_size"):
        return 1, 0.0, "no batch dim"
    tuned = ((manifest.benchmark or {}).get("tune") or {}).get("serving")
    return max_batch, delay_ms, "kiln tune" if tuned else "default"


# ---------------------------------------------------------------- the documents


def inference_service(done: KServeExport) -> dict[str, Any]:
    """The InferenceService (serving.kserve.io/v1beta1) serving the repository."""
    model: dict[str, Any] = {
        "modelFormat": {"name": "triton"},
        "protocolVersion": "v2",
        "runtime": done.serving_runtime,
        "storageUri": done.storage_uri,
    }
    # After the runtime's own args (KServe concatenates them): this model alone is loaded.
    model["args"] = load_only(done.triton.name)
    if done.serving_runtime == TRITON_RUNTIME:  # KServe's runtime declares no port
        model["ports"] = [dict(PORT)]
    model["resources"] = {kind: {"cpu": str(done.cpu), "memory": f"{done.memory_mib}Mi"}
                          for kind in ("requests", "limits")}  # fmt: skip
    replica = done.replica
    return {
        "apiVersion": "serving.kserve.io/v1beta1",
        "kind": "InferenceService",
        "metadata": {
            "name": done.service,
            "annotations": {
                "serving.kserve.io/deploymentMode": "Serverless",
                "kiln.dev/threads": str(done.cpu),
                "kiln.dev/peak-memory": f"{math.ceil(replica.peak_mib)}Mi",
                # Not a served replica's rate: Kiln's runtime in-process, no server between.
                "kiln.dev/in-process-rps": f"{replica.in_process_rps:.1f}",
            },
        },
        "spec": {
            "predictor": {
                "containerConcurrency": done.container_concurrency,
                "scaleMetric": "concurrency",
                "scaleTarget": done.scale_target,
                "model": model,
            }
        },
    }


def load_only(model: str) -> list[str]:
    """Triton's arguments that load `model` alone from the repository, not every model in it."""
    return ["--model-control-mode=explicit", f"--load-model={model}"]


def serving_runtime(done: KServeExport) -> dict[str, Any]:
    """A ServingRuntime (serving.kserve.io/v1alpha1) of Triton with Kiln: KServe's Triton
    runtime in an image that holds Kiln for the Python backend."""
    return {
        "apiVersion": "serving.kserve.io/v1alpha1",
        "kind": "ServingRuntime",
        "metadata": {
            "name": KILN_RUNTIME,
            # KServe applies its Triton defaults (protocol v2) to a runtime of this type.
            "annotations": {"serving.kserve.io/server-type": "tritonserver"},
        },
        "spec": {
            "annotations": {
                "prometheus.kserve.io/port": "8002",
                "prometheus.kserve.io/path": "/metrics",
            },  # fmt: skip
            "supportedModelFormats": [{"name": "triton", "version": "2", "autoSelect": False}],
            "protocolVersions": ["v2", "grpc-v2"],
            "containers": [
                {
                    "name": "kserve-container",
                    "image": done.image,
                    "args": list(TRITON_ARGS),
                    "ports": [dict(PORT)],
                    "securityContext": dict(SECURITY_CONTEXT),
                }
            ],
        },
    }


def engines_of(manifest: Manifest) -> list[str]:
    """The engines serving the artifact: its backend's, or each part's."""
    if manifest.parts:
        return list(dict.fromkeys(p.engine for p in PartsSection.from_json(manifest.parts).parts))
    return [manifest.backend.name]


def image_requirements(manifest: Manifest) -> list[str]:
    """What the image installs from the package index beside the wheel of Kiln: numpy 1.x,
    and at the versions that measured the artifact the packages Kiln's runtime imports and
    the engines the artifact runs on."""
    engines = [ENGINE_DISTRIBUTIONS[engine] for engine in engines_of(manifest)]
    packages = dict.fromkeys([*RUNTIME_PACKAGES, *engines])
    return [IMAGE_NUMPY, *(f"{name}=={metadata.version(name)}" for name in packages)]


def dockerfile(manifest: Manifest) -> str:
    """The image of Kiln's ServingRuntime: Triton, and in its python3 the wheel of this Kiln
    (copied from the build context: the directory the Dockerfile is written to) with what
    its runtime imports."""
    pins = " ".join(f'"{requirement}"' for requirement in image_requirements(manifest))
    wheel = wheel_file()
    pip = "python3 -m pip install --no-cache-dir --break-system-packages"  # PEP 668's Ubuntu
    return "\n".join([
        f"# Written by kiln export (kiln {__version__}): Triton with Kiln's runtime, for the",
        f"# ServingRuntime '{KILN_RUNTIME}'. Build it from this directory (the wheel of Kiln",
        "# beside this file is its build context) and push it, then name it there:",
        f"#   docker build -t REGISTRY/{DEFAULT_IMAGE} . && docker push REGISTRY/{DEFAULT_IMAGE}",
        f"#   kiln export ... --kserve DIR --image REGISTRY/{DEFAULT_IMAGE}",
        f"# Its python3 is CPython {IMAGE_PYTHON} (Ubuntu 24.04, linux/amd64): each requirement",
        "# below has a wheel for it.",
        f"FROM {KILN_BASE_IMAGE}",
        "# Triton's Python backend runs model.py in the python3 first on its PATH: Kiln goes",
        "# there, with the versions of what its runtime imports that measured the artifact, and",
        "# numpy < 2 for the backend's stub.",
        f"COPY {wheel} /tmp/",
        f"RUN {pip} {pins}",
        f"RUN {pip} --no-deps /tmp/{wheel}",
        "# Kiln's state (runtime records, caches) where the non-root user can write.",
        "ENV KILN_HOME=/tmp/kiln",
        "",
    ])  # fmt: skip


_THREADS_FROM = {
    "artifact": "its engine threads",
    "parts": "the threads of its parts, which run at once where independent",
    "physical cores": "the engine's default threads: this machine's physical cores",
}
_BATCH_FROM = {
    "kiln tune": "the max batch `kiln tune --clients` chose for Triton's dynamic batcher",
    "default": "the max batch of Triton's dynamic batcher (Kiln's default; `kiln tune "
               "--clients` measures one)",
    "no batch dim": "one request at a time: the model has no batch dim",
}  # fmt: skip


def _header(done: KServeExport, source: Any) -> list[str]:
    replica = done.replica
    threads = _THREADS_FROM[done.threads_from]
    clients = f"{replica.clients} client{'s' * (replica.clients != 1)}"
    return [
        f"Written by kiln export (kiln {__version__}) from {source.path.resolve()}.",
        f"storageUri {done.storage_uri}: the Triton repository {done.triton.repository.resolve()}"
        f", of which Triton loads model '{done.triton.name}' only (args).",
        f"cpu {done.cpu}: {threads}. memory {done.memory_mib}Mi: {MEMORY_HEADROOM:g} x the peak "
        f"resident memory of one replica, {math.ceil(replica.peak_mib)} MiB, measured in Kiln's "
        "process loading and serving this model (Triton's own server process is not in it).",
        f"containerConcurrency {done.container_concurrency}: {_BATCH_FROM[done.batch_from]}; "
        f"scaleTarget {done.scale_target}: {TARGET_UTILIZATION:.0%} of it (Knative's default "
        f"target utilization), at least 1. kiln.dev/in-process-rps "
        f"{replica.in_process_rps:.1f}: the requests/s Kiln's runtime answered {clients} "
        f"in-process over {replica.seconds:g} s, with no server and no network between: an "
        "upper bound on what a served replica answers, not a measure of one.",
        *([f"Requires: {done.triton.requires}."] if done.triton.requires else []),
    ]


def _yaml(document: dict[str, Any], header: list[str]) -> str:
    comments = "".join(f"# {' '.join(line.splitlines())}\n" for line in header)
    return comments + yaml.safe_dump(document, sort_keys=False, default_flow_style=False)


# ---------------------------------------------------------------- checks and writing


def service_name(model_name: str) -> str:
    """The InferenceService's name for a Triton model: lower case, '_' and '.' as '-' (a
    Kubernetes name); refused when that is still not one KServe takes."""
    service = model_name.lower().replace("_", "-").replace(".", "-")
    if not _SERVICE_NAME.fullmatch(service) or len(service) > 63:
        raise KilnError(
            f"model name {model_name!r}: an InferenceService's name is lower-case letters, "
            "digits and '-', starting with a letter; pass --name."
        )
    return service


def _repo_name(repository: Path) -> str:
    return repository.resolve().name or "models"


def _check_storage_uri(uri: str) -> None:
    scheme, sep, rest = uri.partition("://")
    if not sep or scheme not in STORAGE_SCHEMES or not rest.strip("/"):
        raise KilnError(
            f"--storage-uri {uri!r}: KServe reads {', '.join(s + '://' for s in STORAGE_SCHEMES)}"
            "; give where the Triton repository is, e.g. s3://BUCKET/PATH."
        )


def _check_directory(directory: Path, force: bool) -> None:
    """Refuse, before any work, a directory that cannot take the files, or files of an
    earlier export without `force`."""
    if directory.exists() and not directory.is_dir():
        raise KilnError(f"--kserve {directory}: exists and is not a directory.")
    problem = output_problem(directory, directory=True)
    if problem:
        raise KilnError(f"--kserve {directory}: {problem}. Nothing was written.")
    there = _earlier_files(directory)
    if there and not force:
        raise KilnError(
            f"--kserve {directory}: already holds {', '.join(there)}; pass --force to replace "
            "them, or choose another directory."
        )


def _earlier_files(directory: Path) -> list[str]:
    """The files an export wrote into `directory`, of this Kiln or an earlier one."""
    if not directory.is_dir():
        return []
    written = [f for f in FILES if (directory / f).exists() or (directory / f).is_symlink()]
    return written + sorted(p.name for p in directory.glob(WHEEL_GLOB))


def _install(directory: Path, files: dict[str, str | bytes]) -> None:
    """A new directory is built beside its place and renamed in. Into an existing one (which
    may hold the user's own files too) each file is renamed over the old one, so none is ever
    half written, and an earlier export's file this one does not write is removed. The
    temporary directory never stays."""

    def write(tmp: Path) -> None:
        for file, content in files.items():
            if isinstance(content, bytes):
                (tmp / file).write_bytes(content)
            else:
                (tmp / file).write_text(content)

    try:
        if not directory.exists():
            replace_directory(directory, write)
            return
        earlier = _earlier_files(directory)
        parent = directory.absolute().parent
        with tempfile.TemporaryDirectory(prefix=f".{directory.name}.", dir=parent) as tmp:
            write(Path(tmp))
            for file in files:
                (Path(tmp) / file).replace(directory / file)
        for file in earlier:
            if file not in files:
                (directory / file).unlink()
    except OSError as exc:
        raise KilnError(
            f"--kserve {directory}: could not write the KServe files ({exc.strerror or exc})."
        ) from None
