"""Several models in one `kiln serve`: given as files, or as a Triton-layout model repository
with load and unload while serving. Real server processes on loopback, driven by the real
tritonclient[http]."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import onnx
import pytest
import tritonclient.http as triton
from test_serve import BERT, RESNET, Server, _bert_feeds, _start, _stop, _triton_infer
from tritonclient.utils import InferenceServerException

import kiln
from kiln import zoo

ALL_BERT_OUTPUTS = ["last_hidden_state", "pooler_output"]
BROKEN = "broken"  # a repository model that cannot load


@pytest.fixture(scope="module")
def artifacts(module_home: Path) -> dict[str, Path]:
    """A compiled artifact of each tiny zoo model, named after it (the name it is served as)."""
    where = module_home / "artifacts"
    where.mkdir()
    return {m: kiln.compile(f"zoo:{m}", where / f"{m}.kiln", rounds=0).path for m in (RESNET, BERT)}


@pytest.fixture(scope="module")
def pair(module_home: Path, artifacts: dict[str, Path]) -> Iterator[Server]:
    """`kiln serve resnet-tiny.kiln bert-tiny.kiln`."""
    server = _start(module_home, str(artifacts[RESNET]), str(artifacts[BERT]))
    yield server
    _stop(server)


@pytest.fixture(scope="module")
def repository(module_home: Path, artifacts: dict[str, Path]) -> Path:
    """resnet-tiny at versions 1 (a plain model.onnx) and 2 (its artifact), bert-tiny at 1,
    a folder that is no version, and a model whose only version is garbage."""
    root = module_home / "repo"
    (root / RESNET / "1").mkdir(parents=True)
    onnx.save(zoo.build(RESNET), root / RESNET / "1" / "model.onnx")
    shutil.copytree(artifacts[RESNET], root / RESNET / "2")
    shutil.copytree(artifacts[BERT], root / BERT / "1")
    (root / RESNET / "latest").mkdir()  # not a positive integer: ignored, as Triton does
    (root / BROKEN / "1").mkdir(parents=True)
    (root / BROKEN / "1" / "model.onnx").write_bytes(bytes(range(256)) * 4)
    return root


@pytest.fixture(scope="module")
def served(module_home: Path, repository: Path) -> Iterator[Server]:
    """`kiln serve --model-repository REPO`."""
    server = _start(module_home, f"--model-repository={repository}")
    yield server
    _stop(server)


def _client(server: Server) -> triton.InferenceServerClient:
    return triton.InferenceServerClient(server.url)


def _images(batch: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).random((batch, 3, 32, 32), dtype=np.float32)


def _resnet_infer(client: triton.InferenceServerClient, images: np.ndarray) -> triton.InferResult:
    tensor = triton.InferInput("input", list(images.shape), "FP32")
    tensor.set_data_from_numpy(images)
    return client.infer(RESNET, [tensor])


class Traffic:
    """Requests in a loop on a thread until stopped: what each answered, and every failure.
    `wait_for(n)` waits on the answers themselves, not on time."""

    def __init__(self, call: Callable[[], int]) -> None:
        self._call = call  # one request; its HTTP status
        self.codes: list[int] = []
        self.failures: list[BaseException] = []
        self._stop = threading.Event()
        self._answered = threading.Condition()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                code = self._call()
            except Exception as exc:  # noqa: BLE001 - any failure fails the test
                self.failures.append(exc)
                code = -1
            with self._answered:
                self.codes.append(code)
                self._answered.notify_all()

    def wait_for(self, more: int, code: int = 200) -> None:
        """Until `more` further requests have been answered with `code`."""
        with self._answered:
            target = self.codes.count(code) + more
            done = self._answered.wait_for(lambda: self.codes.count(code) >= target, timeout=60)
        assert done, f"waited 60 s for {more} answers {code}; got {self.codes[-20:]}"


def _bert_traffic(server: Server) -> Traffic:
    client = _client(server)  # its own: tritonclient's client is not thread-safe
    feeds = _bert_feeds(2, 13)

    def call() -> int:
        _triton_infer(client, feeds, True, ["pooler_output"])
        return 200

    return Traffic(call)


def _resnet_traffic(server: Server) -> Traffic:
    """Plain HTTP, so refusals (404 after an unload) are codes to check, not exceptions."""
    http = httpx.Client(base_url=server.base, timeout=60)
    body = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 3, 32, 32],
                        "data": _images(1, 0).ravel().tolist()}]}  # fmt: skip
    return Traffic(lambda: http.post(f"/v2/models/{RESNET}/infer", json=body).status_code)


# ---------------------------------------------------------------- several files


def test_two_models_answer_concurrently_and_equal_kiln_sessions(pair, artifacts) -> None:
    ready = pair.ready
    assert [(m["name"], m["version"], m["state"]) for m in ready["models"]] == [
        (BERT, "1", "READY"),
        (RESNET, "1", "READY"),
    ]
    jobs = [(RESNET, i % 3 + 1, i) if i % 2 else (BERT, i % 3 + 1, i) for i in range(100)]
    local = threading.local()

    def call(job: tuple[str, int, int]) -> list[np.ndarray]:
        model, batch, seed = job
        if not hasattr(local, "client"):
            local.client = _client(pair)
        if model == RESNET:
            return [_resnet_infer(local.client, _images(batch, seed)).as_numpy("logits")]
        result = _triton_infer(local.client, _bert_feeds(batch, 5 + seed % 20, seed), True, None)
        return [result.as_numpy(name) for name in ALL_BERT_OUTPUTS]

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(call, jobs))  # raises on the first failure
    sessions = {m: kiln.Session(path) for m, path in artifacts.items()}
    for (model, batch, seed), got in zip(jobs, answers, strict=True):
        feeds = (
            {"input": _images(batch, seed)} if model == RESNET
            else _bert_feeds(batch, 5 + seed % 20, seed)
        )  # fmt: skip
        for g, want in zip(got, sessions[model].run(None, feeds), strict=True):
            np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-5)
    # Each model counted its own: requests in /metrics, samples in Triton's statistics.
    stats = httpx.get(f"{pair.base}/v2/models/stats").json()["model_stats"]
    counts = {s["name"]: s["inference_count"] for s in stats}
    for model in (RESNET, BERT):
        sent = [job for job in jobs if job[0] == model]
        assert counts[model] == sum(batch for _, batch, _ in sent)
        assert pair.metric(f'kiln_requests_total{{model="{model}"}}') == len(sent)


def test_load_and_unload_need_a_repository(pair) -> None:
    extensions = _client(pair).get_server_metadata()["extensions"]
    assert "model_repository" not in extensions
    for path in [f"models/{RESNET}/load", f"models/{RESNET}/unload"]:
        response = httpx.post(f"{pair.base}/v2/repository/{path}")
        assert response.status_code == 400, path
        assert "--model-repository" in response.json()["error"]


def _serve(home: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kiln", "serve", *args], capture_output=True, text=True,
        env={**os.environ, "KILN_HOME": str(home)}, timeout=120,
    )  # fmt: skip


def test_models_that_cannot_be_served_together_are_one_line_and_exit_2(
    module_home, tmp_path
) -> None:
    other = tmp_path / "other"
    other.mkdir()
    onnx.save(zoo.build(RESNET), other / "m.onnx")
    onnx.save(zoo.build(RESNET), tmp_path / "m.onnx")
    for args, message in [
        ([f"zoo:{RESNET}", f"zoo:{BERT}", "--name", "x"], "--name applies to one model"),
        ([str(tmp_path / "m.onnx"), str(other / "m.onnx")], "would both be served as 'm'"),
        ([], "give the models to serve"),
        ([f"zoo:{RESNET}", "--model-repository", str(tmp_path)], "one or the other"),
        (["--model-repository", str(tmp_path / "no")], f"--model-repository {tmp_path / 'no'}"),
        ([f"zoo:{RESNET}", "nothere.onnx"], "nothere.onnx: no such file"),  # after one loaded
    ]:
        done = _serve(module_home, *args, "--port", "0")
        assert done.returncode == 2 and message in done.stderr, (args, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr


# ---------------------------------------------------------------- a model repository


def test_a_repository_serves_each_models_highest_version(served, repository, module_home) -> None:
    client = _client(served)
    index = client.get_model_repository_index()
    states = [(m["name"], m["version"], m["state"]) for m in index]
    assert states == [(BERT, "1", "READY"), (BROKEN, "1", "UNAVAILABLE"), (RESNET, "2", "READY")]
    ready = httpx.post(f"{served.base}/v2/repository/index", json={"ready": True}).json()
    assert ready == [index[0], index[2]]
    # The model that failed to load says why, and the others serve.
    garbage = repository / BROKEN / "1" / "model.onnx"
    assert f"{garbage}: is not a valid ONNX model" in index[1]["reason"]
    response = httpx.get(f"{served.base}/v2/models/{BROKEN}/config")
    assert response.status_code == 404 and "is not a valid ONNX model" in response.json()["error"]
    assert "model_repository" in client.get_server_metadata()["extensions"]
    assert client.is_server_ready()
    assert client.get_model_metadata(RESNET)["versions"] == ["2"]
    assert client.is_model_ready(RESNET, "2") and not client.is_model_ready(RESNET, "1")
    response = httpx.get(f"{served.base}/v2/models/{RESNET}/versions/1/config")
    assert response.status_code == 404 and "no version '1'" in response.json()["error"]
    answer = _resnet_infer(client, _images(1, 0)).get_response()
    assert answer["model_version"] == "2"
    # The folder that is no version was said once, when the model loaded.
    assert (module_home / "serve.log").read_text().count(f"{RESNET}/latest: ignored") == 1


def test_unload_under_load_leaves_the_other_model_serving_and_reload_serves_again(
    served,
) -> None:
    client = _client(served)
    with _bert_traffic(served) as bert, _resnet_traffic(served) as resnet:
        bert.wait_for(5)
        resnet.wait_for(5)
        client.unload_model(RESNET)  # answers once the model has drained
        resnet.wait_for(3, code=404)
        bert.wait_for(5)  # still answered after the unload
        (row,) = [m for m in client.get_model_repository_index() if m["name"] == RESNET]
        assert (row["state"], row["reason"]) == ("UNAVAILABLE", "unloaded")
        assert not client.is_model_ready(RESNET) and client.is_model_ready(BERT)
        assert client.is_server_ready()  # an unloaded model does not hold readiness down
        response = httpx.get(f"{served.base}/v2/models/{RESNET}")
        assert response.status_code == 404 and "not loaded (unloaded)" in response.json()["error"]
        # how to load it, over either protocol; an unloaded model has nothing to mend
        assert "gRPC RepositoryModelLoad) loads it;" in response.json()["error"]
        client.load_model(RESNET)
        resnet.wait_for(5)
        bert.wait_for(5)
    assert bert.failures == [] and set(bert.codes) == {200}
    # Every resnet request answered: before the unload and after the reload 200, between
    # them 404 (not served) or 503 (loading); none lost, none failed inside the server.
    assert resnet.failures == [] and set(resnet.codes) <= {200, 404, 503}
    assert client.get_model_metadata(RESNET)["versions"] == ["2"]


def test_a_damaged_version_is_refused_and_the_served_one_keeps_answering(
    served, repository
) -> None:
    client = _client(served)
    newer = repository / RESNET / "3"
    shutil.copytree(repository / RESNET / "2", newer)
    model_file = newer / "model.onnx"
    model_file.write_bytes(model_file.read_bytes()[:1000])  # truncated
    try:
        with _resnet_traffic(served) as traffic:
            traffic.wait_for(3)
            response = httpx.post(f"{served.base}/v2/repository/models/{RESNET}/load")
            assert response.status_code == 400
            error = response.json()["error"]
            assert f"failed to load '{RESNET}' version 3" in error and str(model_file) in error
            assert error.endswith("version 2 keeps serving")
            traffic.wait_for(3)
            (row,) = [m for m in client.get_model_repository_index() if m["name"] == RESNET]
            assert (row["state"], row["version"]) == ("READY", "2")
            assert "version 3 failed to load" in row["reason"]
            # Mended, it loads and is swapped in while requests keep coming.
            shutil.copyfile(repository / RESNET / "2" / "model.onnx", model_file)
            client.load_model(RESNET)
            traffic.wait_for(3)
            assert _resnet_infer(client, _images(1, 0)).get_response()["model_version"] == "3"
        assert traffic.failures == [] and set(traffic.codes) == {200}
    finally:
        shutil.rmtree(newer)
    client.load_model(RESNET)  # back to version 2, for the other tests
    assert client.get_model_metadata(RESNET)["versions"] == ["2"]


def test_an_unknown_model_is_404_naming_it_and_the_models_served(served) -> None:
    served_text = f"this server serves '{BERT}', '{RESNET}'"
    for method, path in [
        ("POST", "models/nope/infer"),
        ("GET", "models/nope"),
        ("GET", "models/nope/ready"),
        ("GET", "models/nope/config"),
        ("GET", "models/nope/versions/1/stats"),
    ]:
        response = httpx.request(method, f"{served.base}/v2/{path}", content=b"{}")
        assert response.status_code == 404, path
        assert response.json() == {"error": f"unknown model 'nope'; {served_text}"}, path
    for call in ["load", "unload"]:
        response = httpx.post(f"{served.base}/v2/repository/models/nope/{call}")
        assert response.status_code == 404 and "unknown model 'nope'" in response.json()["error"]
    with pytest.raises(InferenceServerException, match="unknown model 'nope'"):
        _client(served).load_model("nope")


def test_a_repository_folder_is_read_as_triton_reads_it(tmp_path) -> None:
    from kiln.serve.repository import Repository

    said: list[str] = []
    for folder in ["m/1", "m/2/artifact.kiln", "m/10", "m/0", "m/v3", "m/.tmp", "plain/3"]:
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "m/2/artifact.kiln/manifest.json").touch()  # kiln export --runtime kiln's form
    (tmp_path / "plain/3/model.onnx").touch()
    repository = Repository(tmp_path, said.append)
    assert repository.names() == ["m", "plain"]
    assert repository.latest("plain").source == str(tmp_path / "plain/3/model.onnx")
    highest = repository.latest("m")  # 10, by number: not "v3", "0" or the hidden ".tmp"
    assert highest.version == "10"
    with pytest.raises(kiln.KilnError, match="m/10: holds neither a Kiln artifact"):
        _ = highest.source
    shutil.rmtree(tmp_path / "m/10")
    assert repository.latest("m").source == str(tmp_path / "m/2/artifact.kiln")
    # Each ignored folder said once, however often the folder is read.
    assert sorted(said) == sorted([
        f"{tmp_path / 'm/0'}: ignored, a version folder is named by a positive integer (1, 2, …)",
        f"{tmp_path / 'm/v3'}: ignored, a version folder is named by a positive integer (1, 2, …)",
    ])  # fmt: skip
    with pytest.raises(kiln.KilnError, match="no model 'nope' in the repository"):
        repository.latest("nope")
