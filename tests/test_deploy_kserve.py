"""`kiln export --triton REPO --kserve DIR`: the InferenceService (and, for Kiln's runtime,
the ServingRuntime and its Dockerfile) checked field by field against what KServe and
Knative require of them and against the artifact they were sized from. No cluster here:
what KServe's own files say is written down below, with where it comes from."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from string_models import strings_model

import kiln
from kiln.artifact import read_artifact
from kiln.backends import get_backend
from kiln.deploy import export_kserve, kserve
from kiln.deploy.config import DEFAULT_MAX_BATCH
from kiln.errors import KilnError
from kiln.hardware import cpu_info

MEASURE_S = 0.5
TUNED = {"max_batch": 4, "max_delay_ms": 2.5, "clients": 4}
ORT_OPTIONS = {"intra_op_threads": 1}
OV_OPTIONS = {"inference_num_threads": 1}
# kserve/kserve config/runtimes/kserve-tritonserver.yaml: the ClusterServingRuntime's name,
# the model format it serves, and the arguments it starts Triton with.
KSERVE_TRITON = "kserve-tritonserver"
KSERVE_TRITON_ARGS = ["tritonserver", "--model-store=/mnt/models", "--grpc-port=9000",
                      "--http-port=8080", "--allow-grpc=true", "--allow-http=true"]  # fmt: skip
# Knative Serving's API specification, ContainerPort: one port, named "http1" or "h2c";
# its config-autoscaler's default container-concurrency-target-percentage is 70.
KNATIVE_PORT_NAMES = {"http1": "--http-port=", "h2c": "--grpc-port="}
TARGET_UTILIZATION = 0.70


def _served_args(runtime_args: list[str], model: dict[str, Any]) -> list[str]:
    """The arguments Triton starts with: kserve/kserve pkg/controller/v1beta1/inferenceservice/
    utils/utils.go, MergeRuntimeContainers, puts the predictor's own args after the runtime's
    (concatenated, not replaced)."""
    return [*runtime_args, *model.get("args", [])]


def _loaded_models(args: list[str]) -> list[str] | None:
    """What tritonserver started with `args` loads (Triton's model management docs): every
    model of the repository (None) unless --model-control-mode=explicit, then the models
    named by --load-model."""
    modes = [a.split("=", 1)[1] for a in args if a.startswith("--model-control-mode=")]
    if not modes or modes[-1] != "explicit":
        return None
    return [a.split("=", 1)[1] for a in args if a.startswith("--load-model=")]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict[str, Path]:
    """bert-tiny on ORT with 1 intra-op thread and a batcher `kiln tune --clients` chose;
    resnet-tiny with the defaults (threads left to ORT); resnet-tiny on OpenVINO with 1
    thread; a model of strings (no batch dim)."""
    where = tmp_path_factory.mktemp("kserve")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KILN_HOME", str(where / "home"))
        bert = kiln.compile("zoo:bert-tiny", where / "bert.kiln", engine_options=ORT_OPTIONS)
        resnet = kiln.compile("zoo:resnet-tiny", where / "resnet.kiln")
        openvino = kiln.compile("zoo:resnet-tiny", where / "resnet-ov.kiln", backend="openvino",
                                engine_options=OV_OPTIONS)  # fmt: skip
        strings = kiln.compile(strings_model(where / "strings.onnx"), where / "strings.kiln")
    manifest = bert.path / "manifest.json"
    data = json.loads(manifest.read_text())
    data["benchmark"] = {"tune": {"serving": TUNED}}  # what `kiln tune --clients` records
    manifest.write_text(json.dumps(data))
    return {"bert": bert.path, "resnet": resnet.path, "openvino": openvino.path,
            "strings": strings.path}  # fmt: skip


def _load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def _kiln(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln", *args], cwd=cwd, capture_output=True,
                          text=True)  # fmt: skip


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}  # fmt: skip


def _check_port_and_args(container: dict[str, Any], args: list[str]) -> None:
    """Knative routes one port, named for its protocol; Triton must listen on it."""
    (port,) = container["ports"]
    assert port["name"] in KNATIVE_PORT_NAMES and port.get("protocol", "TCP") == "TCP"
    assert f"{KNATIVE_PORT_NAMES[port['name']]}{port['containerPort']}" in args


def _check_autoscaling(predictor: dict[str, Any], concurrency: int) -> None:
    assert predictor["containerConcurrency"] == concurrency
    assert predictor["scaleMetric"] == "concurrency"
    assert abs(predictor["scaleTarget"] - TARGET_UTILIZATION * concurrency) <= 0.5
    assert 1 <= predictor["scaleTarget"] <= concurrency


def _check_resources(model: dict[str, Any], threads: int, peak_mib: float) -> None:
    resources = model["resources"]
    assert resources["requests"] == resources["limits"]  # a guaranteed replica
    assert resources["limits"]["cpu"] == str(threads)
    memory = re.fullmatch(r"(\d+)Mi", resources["limits"]["memory"])
    assert memory and int(memory[1]) >= peak_mib


# ---------------------------------------------------------------- native: KServe's Triton


def test_native_inference_service_is_kserves_triton_sized_from_the_replica(artifacts, tmp_path):
    done = export_kserve(artifacts["resnet"], tmp_path / "repo", tmp_path / "kserve",
                         storage_uri="s3://models/repo", measure_s=MEASURE_S)  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "kserve").iterdir()) == ["inferenceservice.yaml"]
    assert (tmp_path / "repo" / "resnet" / "1" / "model.onnx").is_file()  # what storageUri serves
    isvc = _load(tmp_path / "kserve" / "inferenceservice.yaml")
    assert (isvc["apiVersion"], isvc["kind"]) == ("serving.kserve.io/v1beta1", "InferenceService")
    assert isvc["metadata"]["name"] == "resnet"
    predictor = isvc["spec"]["predictor"]
    model = predictor["model"]
    assert model["modelFormat"]["name"] == "triton"
    assert model["protocolVersion"] == "v2"
    assert model["runtime"] == KSERVE_TRITON
    assert model["storageUri"] == "s3://models/repo"
    _check_port_and_args(model, KSERVE_TRITON_ARGS)  # KServe's runtime declares no port
    # Threads left to ONNX Runtime: one per physical core, as Kiln counts them.
    _check_resources(model, cpu_info().physical_cores, done.replica.peak_mib)
    assert done.threads_from == "physical cores"
    # config.pbtxt runs the threads the cpu limit pays for.
    threads = done.triton.config["parameters"]["intra_op_thread_count"]["string_value"]
    assert threads == model["resources"]["limits"]["cpu"]
    _check_autoscaling(predictor, DEFAULT_MAX_BATCH)  # no tuned batcher: Kiln's default
    annotations = isvc["metadata"]["annotations"]
    assert annotations["serving.kserve.io/deploymentMode"] == "Serverless"  # where Knative acts
    # What was measured, named for what it is: Kiln's runtime in one process, no server.
    assert "kiln.dev/throughput-rps" not in annotations
    assert float(annotations["kiln.dev/in-process-rps"]) == pytest.approx(
        done.replica.in_process_rps, abs=0.05
    )
    assert done.replica.in_process_rps > 0 and done.replica.requests > 0
    header = (tmp_path / "kserve" / "inferenceservice.yaml").read_text().split("\napiVersion")[0]
    assert "in-process" in header and "one replica served" not in header
    assert f"# Requires: {done.triton.requires}." in header and done.triton.requires
    assert done.replica.peak_mib >= done.replica.run_peak_mib > 0


def test_a_tuned_batcher_and_threads_size_the_service(artifacts, tmp_path):
    done = export_kserve(artifacts["bert"], tmp_path / "repo", tmp_path / "kserve",
                         measure_s=MEASURE_S)  # fmt: skip
    isvc = _load(tmp_path / "kserve" / "inferenceservice.yaml")
    predictor = isvc["spec"]["predictor"]
    _check_autoscaling(predictor, TUNED["max_batch"])  # the tuned batch, not the default
    assert done.batch_from == "kiln tune" and done.replica.clients == TUNED["max_batch"]
    _check_resources(predictor["model"], ORT_OPTIONS["intra_op_threads"], done.replica.peak_mib)
    assert done.threads_from == "artifact"
    # The default storage: a PVC named for the repository, said on the way out.
    assert predictor["model"]["storageUri"] == "pvc://kiln-models/repo"


def test_a_model_without_a_batch_dim_takes_one_request_at_a_time(artifacts, tmp_path):
    done = _kiln("export", str(artifacts["strings"]), "--triton", "repo", "--kserve", "kserve",
                 "--measure-s", str(MEASURE_S), cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    predictor = _load(tmp_path / "kserve" / "inferenceservice.yaml")["spec"]["predictor"]
    _check_autoscaling(predictor, 1)
    # The figure is said for what it is: no server and no network were in it.
    assert "in-process" in done.stdout and "one replica served" not in done.stdout
    assert "requires: model.onnx is ONNX IR version" in done.stderr  # what the engine must read


def test_each_service_of_a_shared_repository_loads_only_its_own_model(artifacts, tmp_path):
    repo = tmp_path / "repo"
    for key in ("resnet", "strings"):
        done = export_kserve(artifacts[key], repo, tmp_path / key, measure_s=MEASURE_S)
        model = _load(tmp_path / key / "inferenceservice.yaml")["spec"]["predictor"]["model"]
        assert model["storageUri"] == "pvc://kiln-models/repo"  # the one repository ...
        served = _served_args(KSERVE_TRITON_ARGS, model)
        assert _loaded_models(served) == [done.triton.name]  # ... of which it loads its own
        _check_resources(model, cpu_info().physical_cores, done.replica.peak_mib)
    assert sorted(p.name for p in repo.iterdir()) == ["resnet", "strings"]


# ---------------------------------------------------------------- Kiln's runtime


def test_kiln_runtime_writes_its_serving_runtime_and_image(artifacts, tmp_path):
    done = _kiln("export", str(artifacts["bert"]), "--triton", "repo", "--runtime", "kiln",
                 "--kserve", "kserve", "--storage-uri", "gs://bucket/repo", "--measure-s",
                 str(MEASURE_S), "--json", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout)
    out = tmp_path / "kserve"
    assert sorted(Path(p).name for p in said["files"]) == sorted(p.name for p in out.iterdir())
    assert sorted(p.name for p in out.iterdir()) == [
        "Dockerfile", "inferenceservice.yaml", f"kiln_ml-{kiln.__version__}-py3-none-any.whl",
        "servingruntime.yaml",
    ]  # fmt: skip
    isvc = _load(out / "inferenceservice.yaml")
    runtime = _load(out / "servingruntime.yaml")
    assert (runtime["apiVersion"], runtime["kind"]) == ("serving.kserve.io/v1alpha1",
                                                        "ServingRuntime")  # fmt: skip
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"] != KSERVE_TRITON
    assert model["storageUri"] == "gs://bucket/repo" and model["protocolVersion"] == "v2"
    spec = runtime["spec"]
    # KServe checks that a runtime named by an InferenceService serves its format and protocol.
    assert model["modelFormat"]["name"] in {f["name"] for f in spec["supportedModelFormats"]}
    assert model["protocolVersion"] in spec["protocolVersions"]
    (container,) = spec["containers"]
    assert container["name"] == "kserve-container" and container["image"] == said["image"]
    assert container["args"][:2] == ["tritonserver", "--model-store=/mnt/models"]
    _check_port_and_args(container, container["args"])
    assert _loaded_models(_served_args(container["args"], model)) == ["bert"]
    _check_resources(model, ORT_OPTIONS["intra_op_threads"], said["replica"]["peak_mib"])
    assert said["memory_mib"] == int(model["resources"]["limits"]["memory"][:-2])
    assert said["container_concurrency"] == TUNED["max_batch"]
    # The image: NVIDIA's Triton with the Kiln and engine that measured the artifact, numpy 1.
    dockerfile = (out / "Dockerfile").read_text()
    assert re.search(r"^FROM nvcr\.io/nvidia/tritonserver:\S+-py3$", dockerfile, re.MULTILINE)
    version = get_backend("ort").describe()["version"]
    assert {"numpy<2", f"onnxruntime=={version}"} <= set(_requirements(dockerfile))
    assert (tmp_path / "repo" / "bert" / "1" / "model.py").is_file()


def test_openvino_threads_and_engine_version_go_along(artifacts, tmp_path):
    image = "registry.example/kiln:1"
    done = export_kserve(artifacts["openvino"], tmp_path / "repo", tmp_path / "kserve",
                         runtime="kiln", image=image, measure_s=MEASURE_S)  # fmt: skip
    isvc = _load(tmp_path / "kserve" / "inferenceservice.yaml")
    _check_resources(isvc["spec"]["predictor"]["model"], OV_OPTIONS["inference_num_threads"],
                     done.replica.peak_mib)  # fmt: skip
    runtime = _load(tmp_path / "kserve" / "servingruntime.yaml")
    assert runtime["spec"]["containers"][0]["image"] == image
    version = get_backend("openvino").describe()["version"]
    assert f"openvino=={version}" in _requirements((tmp_path / "kserve" / "Dockerfile").read_text())


# ---------------------------------------------------------------- the image


def _requirements(dockerfile: str) -> list[str]:
    """What the Dockerfile installs from the package index: the quoted requirements of its
    `RUN python3 -m pip install` lines."""
    lines = re.findall(r"^RUN python3 -m pip install (.*)$", dockerfile, re.MULTILINE)
    return [req for line in lines for req in re.findall(r'"([^"]+)"', line)]


def _copied_wheel(dockerfile: str, context: Path) -> Path:
    """The wheel of Kiln the Dockerfile copies from its build context and installs."""
    (name,) = re.findall(r"^COPY (\S+\.whl) ", dockerfile, re.MULTILINE)
    assert re.search(rf"^RUN python3 -m pip install .*--no-deps \S*{re.escape(name)}$", dockerfile,
                     re.MULTILINE)  # fmt: skip
    return context / name


@pytest.fixture(scope="module")
def image(artifacts, tmp_path_factory) -> Path:
    """--runtime kiln's build context for bert-tiny: Dockerfile and the wheel beside it."""
    where = tmp_path_factory.mktemp("image")
    export_kserve(artifacts["bert"], where / "repo", where / "kserve", runtime="kiln",
                  measure_s=MEASURE_S)  # fmt: skip
    return where / "kserve"


@pytest.mark.timeout(120)
def test_the_image_installs_a_wheel_of_this_kiln_from_its_build_context(image, tmp_path):
    dockerfile = (image / "Dockerfile").read_text()
    assert not [r for r in _requirements(dockerfile) if r.startswith("kiln")]  # not the index's
    wheel = _copied_wheel(dockerfile, image)
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                    "--target", str(target), str(wheel)], check=True, timeout=100)  # fmt: skip
    found = subprocess.run(
        [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import kiln, "
         "kiln.runtime.session as s; print(kiln.__version__, s.__file__)", str(target)],
        capture_output=True, text=True, check=True, timeout=100,
    )  # fmt: skip
    version, source = found.stdout.split()
    assert version == kiln.__version__ and Path(source).is_relative_to(target)
    installed = {p.relative_to(target / "kiln") for p in (target / "kiln").rglob("*.py")}
    package = Path(kiln.__file__).parent
    assert installed == {p.relative_to(package) for p in package.rglob("*.py")}


def test_a_partitioned_artifact_is_served_whole_with_its_parts_engines(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    parts = kiln.compile(
        "zoo:two-tower-tiny", tmp_path / "tt.kiln", partition="image=openvino", rounds=0
    )
    done = export_kserve(parts.path, tmp_path / "repo", tmp_path / "kserve", runtime="kiln",
                         measure_s=MEASURE_S)  # fmt: skip
    section = parts.manifest.parts["parts"]
    assert (done.cpu, done.threads_from) == (sum(p["threads"] for p in section), "parts")
    assert done.replica.requests > 0  # one replica ran it whole
    engines = {p["engine"] for p in section}
    assert engines == {"ort", "openvino"}
    names = {
        r.split("==")[0] for r in _requirements((tmp_path / "kserve" / "Dockerfile").read_text())
    }
    assert {"onnxruntime", "openvino"} <= names
    assert (done.triton.version_path / "artifact.kiln" / "parts").is_dir()


# Where a package index cannot be reached: pip's words for it.
_OFFLINE = re.compile(r"NewConnectionError|Max retries exceeded|Temporary failure in name "
                      r"resolution|Network is unreachable|ProxyError|ConnectTimeout|Could not "
                      r"fetch URL|No route to host")  # fmt: skip


@pytest.mark.timeout(600)
def test_every_requirement_has_a_wheel_for_the_images_python(artifacts, image, tmp_path):
    """Each requirement the Dockerfile installs resolves to a wheel for the Python and
    platform of its base image (what `docker build` would find, without Docker), for either
    engine."""
    openvino = kserve.image_requirements(read_artifact(artifacts["openvino"]).manifest)
    requirements = list(dict.fromkeys([*_requirements((image / "Dockerfile").read_text()),
                                        *openvino]))  # fmt: skip
    assert any(r.startswith("openvino==") for r in requirements)
    platforms = [arg for p in kserve.IMAGE_PLATFORMS for arg in ("--platform", p)]
    command = [sys.executable, "-m", "pip", "download", "--only-binary=:all:", "--no-deps",
               "--python-version", kserve.IMAGE_PYTHON, "--implementation", "cp", *platforms,
               "--retries", "1", "--timeout", "30", "--disable-pip-version-check",
               "-d", str(tmp_path), *requirements]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=580)
    if done.returncode != 0 and _OFFLINE.search(done.stderr):
        pytest.skip(f"the package index cannot be reached: {done.stderr.strip()[-300:]}")
    assert done.returncode == 0, done.stderr
    assert len(list(tmp_path.glob("*.whl"))) == len(requirements)


# ---------------------------------------------------------------- bad input


def test_kserve_without_triton_is_one_line_and_exit_2(artifacts, tmp_path):
    done = _kiln("export", str(artifacts["resnet"]), "--kserve", "kserve", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "--triton REPO" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "kserve").exists()


def test_existing_files_are_kept_without_force_and_replaced_with_it(artifacts, tmp_path):
    out = tmp_path / "kserve"
    export_kserve(artifacts["resnet"], tmp_path / "repo", out, runtime="kiln",
                  measure_s=MEASURE_S)  # fmt: skip
    (out / "README").write_text("the user's")
    before, repo = _tree(tmp_path), _tree(tmp_path / "repo")
    done = _kiln("export", str(artifacts["resnet"]), "--triton", "repo", "--version", "2",
                 "--kserve", "kserve", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 2 and "--force" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert _tree(tmp_path) == before and _tree(tmp_path / "repo") == repo  # nothing written
    # With --force: native now, so the kiln runtime's files go; the user's file stays.
    export_kserve(artifacts["resnet"], tmp_path / "repo", out, measure_s=MEASURE_S,
                  force=True)  # fmt: skip
    assert sorted(p.name for p in out.iterdir()) == ["README", "inferenceservice.yaml"]
    assert _load(out / "inferenceservice.yaml")["spec"]["predictor"]["model"]["runtime"] == (
        KSERVE_TRITON
    )
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left


@pytest.mark.parametrize(("given", "message"), [
    ({"storage_uri": "models/repo"}, "--storage-uri 'models/repo'"),
    ({"storage_uri": "ftp://host/repo"}, "--storage-uri 'ftp://host/repo'"),
    ({"image": "kiln:1"}, "goes with --runtime kiln"),
    ({"measure_s": 0}, "--measure-s 0"),
    ({"name": "_model"}, "InferenceService's name"),
    ({"runtime": "tensorrt"}, "unknown runtime 'tensorrt'"),
])  # fmt: skip
def test_bad_input_is_refused_before_anything_is_written(artifacts, tmp_path, given, message):
    with pytest.raises(KilnError, match=re.escape(message)):
        export_kserve(artifacts["resnet"], tmp_path / "repo", tmp_path / "kserve", **given)
    assert sorted(tmp_path.iterdir()) == []
