"""A real Triton server on loopback, from the nvidia-pytriton wheel, to check an exported
repository: its `tritonserver` binary and Python backend serving a model repository (e.g.
`kiln export --runtime kiln` output). For tests and benchmarks; `import kiln` does not load it.

    env = local_triton.ensure_env(local_triton.env_dir(cache))
    with local_triton.running(repo, ["bert-base", "resnet50"], work, env=env) as triton:
        triton.http, triton.grpc  # host:port, as tritonclient takes them

The Python backend's stub is built against numpy 1.x, and Kiln runs on numpy 2, so the models
run in a Python environment of their own: numpy 1.26, the engine versions this environment
has, the pytriton wheel (--no-deps: its server only), and the Kiln imported here on its path.
It is built once (pip, a few minutes) under the cache directory the caller names, keyed by
what goes into it (`cache`/env-KEY), so callers that name the same cache share it;
KILN_TRITON_ENV names another directory. Triton starts each model with the `python3` first on
its PATH: that environment's.

Whatever keeps the server from starting raises TritonUnavailable, with the reason.
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
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.client import HTTPException
from pathlib import Path

from kiln.deploy.wheel import RUNTIME_PACKAGES
from kiln.home import replace_directory

PYTRITON = "nvidia-pytriton==0.7.0"
NUMPY = "numpy==1.26.4"  # what the stub was built against
_KILN_PARENT = Path(__file__).resolve().parents[2]  # the directory `import kiln` found it in
_LOOPBACK = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via a proxy


class TritonUnavailable(Exception):
    """Triton cannot run here; the message says why."""


@dataclass
class TritonEnv:
    root: Path  # the venv
    server: Path  # pytriton's tritonserver directory: bin/, backends/, python_backend_stubs/

    @property
    def libs(self) -> Path:  # the wheel's bundled shared libraries
        return self.server.parent.parent / "nvidia_pytriton.libs"


@dataclass
class Triton:
    proc: subprocess.Popen
    http: str  # host:port
    grpc: str
    log: Path

    def version(self) -> str:
        with _LOOPBACK.open(f"http://{self.http}/v2", timeout=10) as answer:
            return json.load(answer).get("version", "?")


# ---------------------------------------------------------------- the models' environment


def pins() -> list[str]:
    """What Kiln's runtime needs in the models' environment, at this environment's versions,
    so Triton's answers and in-process kiln.Session's come from the same engine."""
    return [NUMPY, *(f"{name}=={metadata.version(name)}" for name in RUNTIME_PACKAGES)]


def env_dir(cache: Path) -> Path:
    """KILN_TRITON_ENV, else `cache`/env-KEY, KEY a hash of what goes into the environment."""
    given = os.environ.get("KILN_TRITON_ENV")
    if given:
        return Path(given)
    key = json.dumps([sys.version_info[:2], PYTRITON, pins()]).encode()
    return Path(cache) / f"env-{hashlib.sha256(key).hexdigest()[:12]}"


def build_env(where: Path) -> None:
    """The venv, built beside `where` and renamed into place: a failed build leaves nothing."""
    where.parent.mkdir(parents=True, exist_ok=True)
    replace_directory(where, _build_venv)


def _build_venv(tmp: Path) -> None:
    pip = [sys.executable, "-m", "pip", "--python", str(tmp / "bin" / "python"), "install",
           "--quiet", "--no-compile", "--disable-pip-version-check"]  # fmt: skip
    steps = [
        [sys.executable, "-m", "venv", "--without-pip", str(tmp)],
        [*pip, *pins()],
        [*pip, "--no-deps", PYTRITON],
    ]
    for step in steps:
        done = subprocess.run(step, capture_output=True, text=True)
        if done.returncode != 0:
            tail = " ".join((done.stderr or done.stdout).split()[-40:])
            raise TritonUnavailable(f"could not build Triton's Python environment "
                                    f"({' '.join(step[:6])} ...): {tail}")  # fmt: skip


def ensure_env(where: Path) -> TritonEnv:
    """The environment at `where` (see `env_dir`), built if missing, with the Kiln imported
    here on its path (not a copy: what Triton runs is what the caller checks)."""
    root = Path(where)
    if not root.is_dir():
        build_env(root)
    found = sorted(root.glob("lib/python3.*/site-packages/pytriton/tritonserver"))
    if not found:
        raise TritonUnavailable(f"{root} holds no pytriton/tritonserver ({PYTRITON})")
    site = found[0].parent.parent
    (site / "kiln-checkout.pth").write_text(f"{_KILN_PARENT}\n")
    return TritonEnv(root, found[0])


# ---------------------------------------------------------------- the server


def free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    for sock in socks:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in socks]
    for sock in socks:
        sock.close()
    return ports


def backends(env: TritonEnv, where: Path) -> Path:
    """Triton's backend directory with the Python stub for this Python version in place, as
    pytriton lays it out (the wheel ships one stub per version beside the backend)."""
    version = f"{sys.version_info[0]}.{sys.version_info[1]}"
    stub = env.server / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise TritonUnavailable(f"{PYTRITON} has no Python-backend stub for Python {version}")
    out = where / "backends"
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(env.server / "backends", out)
    shutil.copy2(stub, out / "python" / stub.name)
    return out


def server_env(env: TritonEnv, home: Path) -> dict[str, str]:
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


def tail(log: Path, lines: int = 12) -> str:
    """The log's last lines, without the CUDA/NVML/DCGM warnings every CPU start prints."""
    kept = [ln for ln in log.read_text(errors="replace").splitlines()
            if "NVML" not in ln and "DCGM" not in ln and "CudaDriver" not in ln]  # fmt: skip
    return " | ".join(kept[-lines:])


def wait_ready(proc: subprocess.Popen, http: str, log: Path, timeout: float) -> None:
    """Poll /v2/health/ready: across a process boundary there is no event to wait on."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise TritonUnavailable(f"tritonserver exited with {proc.returncode}: {tail(log)}")
        try:
            with _LOOPBACK.open(f"http://{http}/v2/health/ready", timeout=2) as answer:
                if answer.status == 200:
                    return
        except (OSError, HTTPException):  # not listening yet, or not ready (HTTPError)
            pass
        time.sleep(0.2)
    raise TritonUnavailable(f"tritonserver was not ready within {timeout:g} s: {tail(log)}")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def running(
    repository: Path, models: list[str], work: Path, *, env: TritonEnv, timeout: float = 300.0,
) -> Iterator[Triton]:  # fmt: skip
    """tritonserver on `repository`, HTTP and gRPC on free loopback ports, `models` loaded at
    start (explicit model control) with the config as written (no auto-complete); ready when
    yielded, stopped (SIGINT, then kill) on the way out. `work` holds its backend directory,
    KILN_HOME and log (work/tritonserver.log)."""
    work.mkdir(parents=True, exist_ok=True)
    http_port, grpc_port, metrics_port = free_ports(3)
    log = work / "tritonserver.log"
    command = [
        str(env.server / "bin" / "tritonserver"),
        f"--model-repository={repository}",
        f"--backend-directory={backends(env, work)}",
        "--disable-auto-complete-config",
        "--model-control-mode=explicit",
        *(f"--load-model={model}" for model in models),
        "--http-address=127.0.0.1", f"--http-port={http_port}",
        "--grpc-address=127.0.0.1", f"--grpc-port={grpc_port}",
        f"--metrics-port={metrics_port}",
        "--exit-timeout-secs=10",
    ]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(command, env=server_env(env, work / "home"), stdout=out,
                                stderr=out)  # fmt: skip
    try:
        http = f"127.0.0.1:{http_port}"
        wait_ready(proc, http, log, timeout)
        yield Triton(proc, http, f"127.0.0.1:{grpc_port}", log)
    finally:
        stop(proc)
