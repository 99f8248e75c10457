"""`kiln export --triton` of a pipeline artifact on a real Triton server (the environment and
server of test_triton_server): the model answers each query as the plain function does, over
HTTP and gRPC, and a client's mistake is answered 400 / INVALID_ARGUMENT."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as triton_http
from test_pipeline_compile import WIDTH, _matmul
from test_pipeline_serve import GLUE
from test_triton_server import WANT_STATUS, _grpc, env, unavailable  # noqa: F401 (a fixture)
from tritonclient.utils import InferenceServerException
from typer.testing import CliRunner

import kiln
from kiln.cli import app
from kiln.deploy.local_triton import Triton, TritonEnv, TritonUnavailable, running
from kiln.errors import KilnError
from kiln.pipeline import compile_pipeline, load_function

pytestmark = pytest.mark.timeout(600)

MODEL = "label"


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny pipeline (bytes of 64 floats in, a label as JSON out, with an early exit),
    compiled as test_pipeline_serve compiles it."""
    root = tmp_path_factory.mktemp("pipeline")
    (root / "glue.py").write_text(textwrap.dedent(GLUE))
    rng = np.random.default_rng(3)
    models = {
        "embed": str(_matmul(root / "embed.onnx", rng.standard_normal((WIDTH, 8), np.float32))),
        "cls": str(_matmul(root / "cls.onnx", rng.standard_normal((WIDTH, 4), np.float32))),
    }
    out = root / f"{MODEL}.kiln"
    compile_pipeline(f"{root}/glue.py:label", models, f"{root}/glue.py:queries", out)
    return out


@pytest.fixture(scope="module")
def server(env: TritonEnv, compiled: Path, tmp_path_factory) -> Iterator[Triton]:  # noqa: F811
    where = tmp_path_factory.mktemp("triton-pipeline")
    repo = where / "repo"
    done = CliRunner().invoke(app, ["export", str(compiled), "--triton", str(repo)])
    assert done.exit_code == 0, done.output
    try:
        with running(repo, [MODEL], where, env=env, timeout=120) as triton:
            yield triton
    except TritonUnavailable as exc:
        unavailable(str(exc))


def _expected(artifact: Path) -> tuple[list[bytes], list[object]]:
    """The queries, and the plain function's answers over the stages' artifacts, as JSON reads."""
    function = load_function(f"{artifact}/glue.py:label")
    queries = list(load_function(f"{artifact}/glue.py:queries")())
    sessions = {name: kiln.Session(str(artifact / "stages" / f"{name}.kiln"))
                for name in ("embed", "cls")}  # fmt: skip
    return queries, [json.loads(json.dumps(function(q, **sessions))) for q in queries]


def _input(module, queries: list[bytes]):
    tensor = module.InferInput("input", [len(queries), 1], "BYTES")
    tensor.set_data_from_numpy(np.array(queries, dtype=object).reshape(-1, 1))
    return tensor


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_triton_answers_a_pipeline_as_the_plain_function(server: Triton, compiled: Path,
                                                          protocol: str) -> None:  # fmt: skip
    module = triton_http if protocol == "http" else _grpc()
    url = server.http if protocol == "http" else server.grpc
    queries, expected = _expected(compiled)
    with closing(module.InferenceServerClient(url)) as client:
        one = [client.infer(MODEL, [_input(module, [q])]).as_numpy("output") for q in queries]
        together = client.infer(MODEL, [_input(module, queries)]).as_numpy("output")
    assert [json.loads(a.ravel()[0]) for a in one] == expected
    assert [json.loads(a) for a in together.ravel()] == expected
    assert any(a["label"] is None for a in expected), "the early exit is taken by some queries"


def test_concurrent_requests_are_batched_as_streams(server: Triton, compiled: Path) -> None:
    queries, expected = _expected(compiled)
    with closing(triton_http.InferenceServerClient(server.http, concurrency=8)) as client:
        pending = [client.async_infer(MODEL, [_input(triton_http, [q])]) for q in queries]
        answers = [json.loads(p.get_result().as_numpy("output").ravel()[0]) for p in pending]
    assert answers == expected


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_a_client_mistake_is_invalid_argument(server: Triton, compiled: Path,
                                              protocol: str) -> None:  # fmt: skip
    module = triton_http if protocol == "http" else _grpc()
    url = server.http if protocol == "http" else server.grpc
    floats = module.InferInput("input", [1, 1], "FP32")  # not BYTES
    floats.set_data_from_numpy(np.zeros((1, 1), np.float32))
    misnamed = module.InferInput("image", [1, 1], "BYTES")
    misnamed.set_data_from_numpy(np.array([[b"x"]], dtype=object))
    short = _input(module, [b"not 64 floats"])  # the function fails on it: the query's fault
    queries, expected = _expected(compiled)
    with closing(module.InferenceServerClient(url)) as client:
        for mistake in (floats, misnamed, short):
            with pytest.raises(InferenceServerException) as answer:
                client.infer(MODEL, [mistake])
            assert answer.value.status() == WANT_STATUS[protocol], answer.value.message()
        (answer,) = client.infer(MODEL, [_input(module, queries[:1])]).as_numpy("output").ravel()
    assert json.loads(answer) == expected[0]  # and the model still answers


def _kiln(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln", *args], capture_output=True, text=True)


@pytest.mark.parametrize(("flags", "reason"), [
    (["--runtime", "native"], "only Kiln's runtime runs"),
    (["--kserve", "kserve"], "--kserve sizes a replica of one model"),
])  # fmt: skip
def test_what_cannot_run_a_pipeline_is_refused(compiled: Path, tmp_path: Path, flags: list[str],
                                               reason: str) -> None:  # fmt: skip
    repo = tmp_path / "repo"
    done = _kiln("export", str(compiled), "--triton", str(repo), *flags)
    assert done.returncode == 2, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert reason in done.stderr and not repo.exists()


def test_the_api_refuses_the_native_runtime_for_a_pipeline(compiled: Path, tmp_path: Path) -> None:
    with pytest.raises(KilnError, match="--runtime kiln"):
        kiln.deploy.export_triton(compiled, tmp_path / "repo")
    assert not (tmp_path / "repo").exists()
