"""`kiln export --runtime kiln` on a real Triton server: the `tritonserver` binary and Python
backend of the nvidia-pytriton wheel, on loopback, driven by tritonclient over HTTP and gRPC.

The Python backend's stub is built against numpy 1.x, and Kiln's .venv runs numpy 2 (the
pytriton wheel would also downgrade numpy and protobuf there), so the model runs in a
separate virtual environment: numpy 1.26, the engine versions this .venv has, the pytriton
wheel, and this checkout's Kiln on its path. It is built once and cached in pytest's cache
directory, keyed by those versions (KILN_TRITON_ENV names a directory to use instead).
Triton starts the model with the `python3` first on its PATH: that environment's.

Skipped where the environment cannot be built or the server cannot start, with the reason;
under CI=true that fails instead.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as metadata
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as triton_http
from string_models import strings_model
from tritonclient.utils import InferenceServerException

import kiln
from kiln.deploy import export_triton

CI = os.environ.get("CI") == "true"
PYTRITON = "nvidia-pytriton==0.7.0"
NUMPY = "numpy==1.26.4"  # what the stub was built against
# Kiln's runtime needs these in the model's environment; pinned to this .venv's versions so
# Triton's answers and the reference come from the same engine.
RUNTIME_PACKAGES = ("onnxruntime", "onnx", "onnx-ir", "onnxscript", "psutil")
BERT, RESNET, STRINGS = "bert-tiny", "resnet-tiny", "strings"
BERT_ORT, RESNET_OPENVINO = "bert-tiny-ort", "resnet-tiny-openvino"  # native forms
BATCH_DELAY_MS = 50  # bert's tuned batcher: a window wide enough for concurrent requests


def unavailable(why: str) -> None:
    if CI:
        pytest.fail(f"{why}; CI=true: the real-Triton test must run in CI")
    pytest.skip(why)


# ---------------------------------------------------------------- the model's environment


def _pins() -> list[str]:
    return [NUMPY, *(f"{name}=={metadata.version(name)}" for name in RUNTIME_PACKAGES)]


def _env_dir(config: pytest.Config) -> Path:
    given = os.environ.get("KILN_TRITON_ENV")
    if given:
        return Path(given)
    key = json.dumps([sys.version_info[:2], PYTRITON, _pins()]).encode()
    name = f"env-{hashlib.sha256(key).hexdigest()[:12]}"
    cache = getattr(config, "cache", None)  # None under -p no:cacheprovider
    base = cache.mkdir("kiln-triton") if cache else Path(tempfile.gettempdir()) / "kiln-triton"
    return Path(base) / name


def _build_env(where: Path) -> None:
    """A venv with numpy 1.26, the runtime's engines and the pytriton wheel (its server and
    Python backend only: --no-deps), built beside `where` and renamed into place."""
    tmp = where.with_name(where.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    pip = [sys.executable, "-m", "pip", "--python", str(tmp / "bin" / "python"), "install",
           "--quiet", "--no-compile", "--disable-pip-version-check"]  # fmt: skip
    steps = [
        [sys.executable, "-m", "venv", "--without-pip", str(tmp)],
        [*pip, *_pins()],
        [*pip, "--no-deps", PYTRITON],
    ]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tail = " ".join((done.stderr or done.stdout).split()[-40:])
            unavailable(f"could not build Triton's Python environment ({' '.join(step[:6])} "
                        f"...): {tail}")  # fmt: skip
    tmp.rename(where)


@dataclass
class Env:
    root: Path  # the venv
    server: Path  # pytriton's tritonserver directory: bin/, backends/, python_backend_stubs/

    @property
    def libs(self) -> Path:  # the wheel's bundled shared libraries
        return self.server.parent.parent / "nvidia_pytriton.libs"


@pytest.fixture(scope="module")
def env(request: pytest.FixtureRequest) -> Env:
    root = _env_dir(request.config)
    if not root.is_dir():
        _build_env(root)
    found = sorted(root.glob("lib/python3.*/site-packages/pytriton/tritonserver"))
    if not found:
        unavailable(f"{root} holds no pytriton/tritonserver ({PYTRITON})")
    site = found[0].parent.parent
    # This checkout's Kiln (not a copy): what the tests exercise is what Triton runs.
    src = Path(kiln.__file__).resolve().parent.parent
    (site / "kiln-checkout.pth").write_text(f"{src}\n")
    return Env(root, found[0])


# ---------------------------------------------------------------- the server


@dataclass
class Server:
    proc: subprocess.Popen
    http: str  # host:port, as tritonclient wants it
    grpc: str
    log: Path
    exports: dict[str, object]  # model → its TritonExport
    artifacts: dict[str, Path]
    sessions: dict[str, kiln.Session] = field(default_factory=dict)

    def session(self, model: str) -> kiln.Session:
        """kiln.Session on the artifact Triton serves a copy of: the reference answers."""
        if model not in self.sessions:
            self.sessions[model] = kiln.Session(self.artifacts[model])
        return self.sessions[model]


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    for sock in socks:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in socks]
    for sock in socks:
        sock.close()
    return ports


def _backends(env: Env, where: Path) -> Path:
    """Triton's backend directory with the Python stub for this Python version in place, as
    pytriton lays it out (the wheel ships one stub per version beside the backend)."""
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    stub = env.server / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        unavailable(f"{PYTRITON} has no Python-backend stub for Python {version}")
    backends = where / "backends"
    shutil.copytree(env.server / "backends", backends)
    shutil.copy2(stub, backends / "python" / stub.name)
    return backends


def _server_env(env: Env, home: Path) -> dict[str, str]:
    """The stub embeds libpython: this Python's own where it is shared, so the interpreter
    and the venv's standard library are one build."""
    libs = [str(env.libs)]
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        libs.insert(0, sysconfig.get_config_var("LIBDIR"))
    paths = [*libs, os.environ.get("LD_LIBRARY_PATH", "")]
    return {
        **os.environ,
        "PATH": f"{env.root / 'bin'}{os.pathsep}{os.environ['PATH']}",
        "LD_LIBRARY_PATH": os.pathsep.join(p for p in paths if p),
        "KILN_HOME": str(home),
    }


def _export(where: Path) -> tuple[dict[str, Path], dict[str, object]]:
    """bert-tiny (its tuned batcher set to a delay, as `kiln tune --clients` records it),
    resnet-tiny and a model of strings without a batch dim, compiled and exported for Kiln's
    runtime into one repository."""
    artifacts = {m: kiln.compile(f"zoo:{m}", where / f"{m}.kiln").path for m in (BERT, RESNET)}
    strings = strings_model(where / "strings.onnx")
    artifacts[STRINGS] = kiln.compile(strings, where / f"{STRINGS}.kiln").path
    manifest = artifacts[BERT] / "manifest.json"
    data = json.loads(manifest.read_text())
    data["benchmark"] = {"tune": {"serving": {"max_batch": 8, "max_delay_ms": BATCH_DELAY_MS}}}
    manifest.write_text(json.dumps(data))
    exports = {m: export_triton(a, where / "repo", runtime="kiln") for m, a in artifacts.items()}
    # The native forms, beside them: Triton's ONNX Runtime backend, and OpenVINO's.
    openvino = kiln.compile(f"zoo:{RESNET}", where / "resnet-ov.kiln", backend="openvino").path
    for model, artifact in [(BERT_ORT, artifacts[BERT]), (RESNET_OPENVINO, openvino)]:
        exports[model] = export_triton(artifact, where / "repo", name=model)
    return artifacts, exports


def _wait_ready(proc: subprocess.Popen, http: str, log: Path, timeout: float = 120) -> None:
    """Poll /v2/health/ready: across a process boundary there is no event to wait on; the
    timeout is a safety net."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            unavailable(f"tritonserver exited with {proc.returncode}: {_tail(log)}")
        try:
            if httpx.get(f"http://{http}/v2/health/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    unavailable(f"tritonserver was not ready within {timeout:g} s: {_tail(log)}")


def _tail(log: Path) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines()
             if "NVML" not in ln and "DCGM" not in ln and "CudaDriver" not in ln]  # fmt: skip
    return " | ".join(lines[-12:])


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server(env: Env, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    where = tmp_path_factory.mktemp("triton")
    home = where / "home"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KILN_HOME", str(home))
        artifacts, exports = _export(where)
    http_port, grpc_port, metrics_port = _free_ports(3)
    log = where / "tritonserver.log"
    command = [
        str(env.server / "bin" / "tritonserver"),
        f"--model-repository={where / 'repo'}",
        f"--backend-directory={_backends(env, where)}",
        "--disable-auto-complete-config",  # Triton serves Kiln's config as written, or refuses
        # Kiln's runtime at start; the native forms are loaded by a test (see there).
        "--model-control-mode=explicit",
        *(f"--load-model={model}" for model in (BERT, RESNET, STRINGS)),
        "--http-address=127.0.0.1", f"--http-port={http_port}",
        "--grpc-address=127.0.0.1", f"--grpc-port={grpc_port}",
        f"--metrics-port={metrics_port}",
        "--exit-timeout-secs=10",
    ]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(command, env=_server_env(env, home), stdout=out, stderr=out)
    try:
        http = f"127.0.0.1:{http_port}"
        _wait_ready(proc, http, log)
        yield Server(proc, http, f"127.0.0.1:{grpc_port}", log, exports, artifacts)
    finally:
        _stop(proc)


# ---------------------------------------------------------------- requests


def _bert_feeds(batch: int, seq: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, seq), np.int64)
    mask[0, seq - seq // 3 :] = 0  # a padded first row, as real traffic has
    return {
        "input_ids": rng.integers(0, 1000, (batch, seq)).astype(np.int64),
        "attention_mask": mask,
        "token_type_ids": np.zeros((batch, seq), np.int64),
    }


def _resnet_feeds(batch: int, seed: int) -> dict[str, np.ndarray]:
    return {"input": np.random.default_rng(seed).random((batch, 3, 32, 32), np.float32)}


def _inputs(module, feeds: dict[str, np.ndarray]) -> list:
    """tritonclient inputs (module: tritonclient.http or tritonclient.grpc)."""
    tensors = []
    for name, array in feeds.items():
        tensor = module.InferInput(name, list(array.shape), _datatype(array))
        tensor.set_data_from_numpy(array)
        tensors.append(tensor)
    return tensors


def _datatype(array: np.ndarray) -> str:
    from tritonclient.utils import np_to_triton_dtype

    return np_to_triton_dtype(array.dtype)


def _grpc():
    try:
        import tritonclient.grpc as triton_grpc
    except (ImportError, RuntimeError) as exc:  # RuntimeError: tritonclient without grpcio
        unavailable(f"tritonclient.grpc cannot be imported ({exc}); pip install grpcio")
    return triton_grpc


CASES = [
    (BERT, _bert_feeds(1, 16, 0)),
    (BERT, _bert_feeds(2, 24, 1)),
    (RESNET, _resnet_feeds(1, 2)),
    (RESNET, _resnet_feeds(3, 3)),
]


def _assert_same(got: dict[str, np.ndarray], want: list[np.ndarray], names: list[str]) -> None:
    for name, expected in zip(names, want, strict=True):
        np.testing.assert_allclose(got[name], expected, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_triton_answers_equal_kiln_session(server: Server, protocol: str) -> None:
    module = triton_http if protocol == "http" else _grpc()
    url = server.http if protocol == "http" else server.grpc
    with closing(module.InferenceServerClient(url)) as client:  # open connections delay exit
        _answers_equal(client, module, server)


def _answers_equal(client, module, server: Server) -> None:
    for model, feeds in CASES:
        session = server.session(model)
        result = client.infer(model, _inputs(module, feeds))
        names = session.output_names
        _assert_same({n: result.as_numpy(n) for n in names}, session.run(None, feeds), names)


def test_triton_serves_the_config_kiln_wrote(server: Server) -> None:
    with closing(triton_http.InferenceServerClient(server.http)) as client:
        _configs_as_written(client, server)


def _configs_as_written(client: triton_http.InferenceServerClient, server: Server) -> None:
    for model in (BERT, RESNET):
        served = client.get_model_config(model)
        written = server.exports[model].config
        assert served["backend"] == "python"
        assert served["max_batch_size"] == written["max_batch_size"] > 0
        for key in ("input", "output"):
            assert [(t["name"], t["data_type"], [int(d) for d in t["dims"]]) for t in served[key]]\
                == [(t["name"], t["data_type"], t["dims"]) for t in written[key]]  # fmt: skip
        delay = int(served["dynamic_batching"].get("max_queue_delay_microseconds", 0))
        assert delay == written["dynamic_batching"].get("max_queue_delay_microseconds", 0)
        assert served["instance_group"][0]["kind"] == "KIND_CPU"
    assert server.exports[BERT].config["max_batch_size"] == 8  # the tuned batcher's
    assert int(client.get_model_config(BERT)["dynamic_batching"]["max_queue_delay_microseconds"])\
        == BATCH_DELAY_MS * 1000  # fmt: skip


def test_concurrent_requests_are_batched_by_triton_and_answered_right(server: Server) -> None:
    with closing(triton_http.InferenceServerClient(server.http, concurrency=8)) as client:
        _batched(client, server)


def _batched(client: triton_http.InferenceServerClient, server: Server) -> None:
    stats = client.get_inference_statistics(BERT)["model_stats"][0]
    before = int(stats["inference_count"]), int(stats["execution_count"])
    requests = [_bert_feeds(1, 16, 100 + i) for i in range(12)]
    pending = [client.async_infer(BERT, _inputs(triton_http, f)) for f in requests]
    results = [p.get_result() for p in pending]
    session = server.session(BERT)
    for feeds, result in zip(requests, results, strict=True):
        names = session.output_names
        _assert_same({n: result.as_numpy(n) for n in names}, session.run(None, feeds), names)
    stats = client.get_inference_statistics(BERT)["model_stats"][0]
    inferences = int(stats["inference_count"]) - before[0]
    executions = int(stats["execution_count"]) - before[1]
    assert inferences == len(requests)
    assert executions < inferences  # requests shared executions within the tuned delay


def test_a_request_kilns_session_refuses_is_answered_with_its_reason(server: Server) -> None:
    with closing(triton_http.InferenceServerClient(server.http)) as client:
        with pytest.raises(InferenceServerException, match="at most seq="):
            client.infer(BERT, _inputs(triton_http, _bert_feeds(1, 4096, 5)))
        model, feeds = CASES[0]  # and the model still answers
        result = client.infer(model, _inputs(triton_http, feeds))
        session = server.session(model)
        names = session.output_names
        _assert_same({n: result.as_numpy(n) for n in names}, session.run(None, feeds), names)


def test_text_tensors_and_a_model_without_a_batch_dim(server: Server) -> None:
    text = np.array(["kiln", "héllo wörld", ""], dtype=object)
    session = server.session(STRINGS)
    want = dict(zip(session.output_names, session.run(None, {"text": text}), strict=True))
    with closing(triton_http.InferenceServerClient(server.http)) as client:
        assert int(client.get_model_config(STRINGS).get("max_batch_size", 0)) == 0
        tensor = triton_http.InferInput("text", [len(text)], "BYTES")
        tensor.set_data_from_numpy(np.array([t.encode() for t in text], dtype=object))
        result = client.infer(STRINGS, [tensor])
    assert [b.decode() for b in result.as_numpy("upper")] == list(want["upper"])
    np.testing.assert_array_equal(result.as_numpy("count"), want["count"])


@pytest.mark.parametrize(("model", "backend"), [(BERT_ORT, "onnxruntime"),
                                                (RESNET_OPENVINO, "openvino")])  # fmt: skip
def test_native_configs_pass_tritons_own_parse_and_checks(server: Server, model, backend) -> None:
    """The pytriton wheel's server has only the Python backend. Triton parses config.pbtxt,
    normalizes it and checks it (inputs, outputs, batching, instance groups) before it looks
    for the backend: a load that stops at the missing backend got past all of that. (A
    config it cannot parse answers "failed to poll from model repository" instead.)"""
    answer = httpx.post(f"http://{server.http}/v2/repository/models/{model}/load", timeout=60)
    assert answer.status_code == 400
    assert f"unable to find backend library for backend '{backend}'" in answer.json()["error"]
