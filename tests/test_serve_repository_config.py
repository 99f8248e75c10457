"""`kiln serve --model-repository` reads each model's config.pbtxt as Triton does: the fields
it honours change what is served, the ones it cannot honour leave the model UNAVAILABLE with
a reason naming the field; and every server answers the repository index."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton_http
from onnx import TensorProto, helper
from test_serve import _start, _stop

import kiln
from kiln.runtime.batcher import Batcher
from kiln.serve.models import READY, UNAVAILABLE, ModelSet, _engine
from kiln.serve.repository import Repository
from kiln.serve.service import Refused, check_inputs

pytestmark = pytest.mark.timeout(120)
WIDTH = 4


def _write_model(path: Path, batched: bool = True, width: int | str = WIDTH) -> Path:
    """y = x + 1 on [batch, width] floats (or a fixed [2, width] without a batch dim)."""
    first = "batch" if batched else 2
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "one"], ["y"])], "add",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [first, width])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [first, width])],
        [helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])],
    )  # fmt: skip
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _model(root: Path, config: str, *, versions=(1,), filename="model.onnx", batched=True):
    """Model 'm' of the repository `root`: `versions` each holding `filename`, and `config`."""
    for version in versions:
        _write_model(root / "m" / str(version) / filename, batched)
    (root / "m" / "config.pbtxt").write_text(config)
    return root


@pytest.fixture
def load(tmp_path: Path) -> Iterator:
    """Load the repository at tmp_path; the model set, closed at the end."""
    sets: list[ModelSet] = []

    def loaded(root: Path = tmp_path) -> tuple[ModelSet, dict[str, str]]:
        models = ModelSet(repository=Repository(root))
        sets.append(models)
        (row,) = [r for r in models.load_repository() if r["name"] == "m"]
        return models, row

    yield loaded
    for models in sets:
        models.close()


def _refused(row: dict[str, str], *words: str) -> None:
    assert row["state"] == UNAVAILABLE, row
    for word in words:
        assert word in row["reason"], row["reason"]


# ---------------------------------------------------------------- honoured


def test_default_model_filename_names_the_model_file(tmp_path, load) -> None:
    _model(tmp_path, 'default_model_filename: "add.onnx"\n', filename="add.onnx")
    models, row = load()
    assert row["state"] == READY, row
    assert models.get("m").source == str(tmp_path / "m/1/add.onnx")


def test_default_model_filename_may_name_a_kiln_artifact(tmp_path, load) -> None:
    source = _write_model(tmp_path / "src" / "add.onnx")
    (tmp_path / "m/1").mkdir(parents=True)
    kiln.compile(str(source), tmp_path / "m/1/model.kiln", rounds=0)
    (tmp_path / "m/config.pbtxt").write_text('default_model_filename: "model.kiln"\n')
    shutil.rmtree(tmp_path / "src")
    models, row = load()
    assert row["state"] == READY, row
    assert models.get("m").source == str(tmp_path / "m/1/model.kiln")


def test_max_batch_size_0_serves_whole_shapes_and_batches_nothing(tmp_path, load) -> None:
    _model(tmp_path, "max_batch_size: 0\n")
    models, row = load()
    config = models.get("m").config()
    assert row["state"] == READY and config["max_batch_size"] == 0
    assert config["input"][0]["dims"] == [-1, WIDTH]  # the batch dim is the model's own
    assert "dynamic_batching" not in config and not models.get("m").batcher.combine


def test_max_batch_size_0_counts_each_execution_as_batch_size_1(tmp_path) -> None:
    # Triton's statistics for a model without a batch axis: each execution is one inference
    # of batch size 1, whatever the leading dim of the request's tensors.
    repository = _model(tmp_path / "repo", "max_batch_size: 0\n")
    server = _start(tmp_path, f"--model-repository={repository}")
    try:
        client = triton_http.InferenceServerClient(server.url)
        for rows in (3, 5):
            tensor = triton_http.InferInput("x", [rows, WIDTH], "FP32")
            tensor.set_data_from_numpy(np.zeros((rows, WIDTH), np.float32))
            client.infer("m", [tensor])
        (stats,) = client.get_inference_statistics("m")["model_stats"]
    finally:
        _stop(server)
    assert stats["execution_count"] == 2 and stats["inference_count"] == 2
    (batch,) = stats["batch_stats"]
    assert batch["batch_size"] == 1 and batch["compute_infer"]["count"] == 2


def test_max_batch_size_sets_the_batch_limit(tmp_path, load) -> None:
    _model(tmp_path, "max_batch_size: 4\ndynamic_batching { }\n")
    models, _ = load()
    assert models.get("m").batcher.max_batch == 4
    assert models.get("m").config()["max_batch_size"] == 4


def test_dynamic_batching_delay_and_preferred_sizes_are_the_batchers(tmp_path, load) -> None:
    _model(tmp_path, "max_batch_size: 8\ndynamic_batching { max_queue_delay_microseconds: "
                     "2500 preferred_batch_size: [2, 4] }\n")  # fmt: skip
    models, _ = load()
    batcher = models.get("m").batcher
    assert batcher.max_delay == pytest.approx(0.0025) and batcher.preferred == (2, 4)
    assert batcher.combine
    config = models.get("m").config()["dynamic_batching"]
    assert config == {"max_queue_delay_microseconds": 2500, "preferred_batch_size": [2, 4]}


def test_without_dynamic_batching_each_request_runs_alone(tmp_path, load) -> None:
    _model(tmp_path, "max_batch_size: 8\n")
    models, _ = load()
    assert not models.get("m").batcher.combine
    assert "dynamic_batching" not in models.get("m").config()


def _one(samples: int = 1) -> dict[str, np.ndarray]:
    return {"x": np.zeros((samples, WIDTH), np.float32)}


def _recording() -> tuple[list[int], callable]:
    sizes: list[int] = []

    def run_batch(requests):
        sizes.append(sum(r["x"].shape[0] for r in requests))
        return [[r["x"]] for r in requests]

    return sizes, run_batch


def test_a_preferred_batch_goes_at_once_without_waiting_out_the_delay() -> None:
    sizes, run_batch = _recording()
    batcher = Batcher(run_batch, max_batch=8, max_delay=600, preferred=(2,))
    futures = [batcher.submit(_one()) for _ in range(2)]
    batcher.start()
    for future in futures:
        future.result(timeout=30)  # 600 s of delay: only a preferred size sends it this soon
    batcher.close()
    assert sizes == [2]


def test_the_largest_preferred_size_the_queue_forms_is_taken() -> None:
    sizes, run_batch = _recording()
    batcher = Batcher(run_batch, max_batch=8, max_delay=0, preferred=(2, 4))
    futures = [batcher.submit(_one()) for _ in range(5)]  # queued before the worker runs
    batcher.start()
    for future in futures:
        future.result(timeout=30)
    batcher.close()
    assert sizes == [4, 1]


def test_requests_are_not_combined_without_dynamic_batching() -> None:
    sizes, run_batch = _recording()
    batcher = Batcher(run_batch, max_batch=8, max_delay=0, combine=False)
    futures = [batcher.submit(_one()) for _ in range(3)]
    batcher.start()
    for future in futures:
        future.result(timeout=30)
    batcher.close()
    assert sizes == [1, 1, 1]


def test_instance_count_runs_that_many_batches_side_by_side(tmp_path, load) -> None:
    both = threading.Barrier(2, timeout=30)  # passes only with two batches running at once

    def run_batch(requests):
        both.wait()
        return [[r["x"]] for r in requests]

    batcher = Batcher(run_batch, max_batch=1, max_delay=0, workers=2)
    futures = [batcher.submit(_one()) for _ in range(2)]
    batcher.start()
    for future in futures:
        future.result(timeout=30)
    batcher.close()
    _model(tmp_path, "instance_group [ { count: 2 kind: KIND_CPU } ]\n")
    models, _ = load()
    assert models.get("m").batcher.workers == 2
    assert models.get("m").config()["instance_group"][0]["count"] == 2


def test_version_policy_specific_serves_the_version_named(tmp_path, load) -> None:
    _model(tmp_path, "version_policy: { specific: { versions: [1] } }\n", versions=(1, 2))
    models, row = load()
    assert row["state"] == READY and models.get("m").version == "1"


def test_inputs_and_outputs_written_as_the_model_has_them_load(tmp_path, load) -> None:
    tensors = (
        "max_batch_size: 8\ndynamic_batching { }\n"
        f'input [ {{ name: "x" data_type: TYPE_FP32 dims: [ {WIDTH} ] }} ]\n'
        f'output [ {{ name: "y" data_type: TYPE_FP32 dims: [ -1 ] }} ]\n'
    )
    _model(tmp_path, tensors)
    _, row = load()
    assert row["state"] == READY, row


def test_input_dims_the_config_fixes_are_the_ones_requests_must_have(tmp_path, load) -> None:
    _write_model(tmp_path / "m/1/model.onnx", width="n")  # any width
    (tmp_path / "m/config.pbtxt").write_text(
        f'max_batch_size: 8\ninput [ {{ name: "x" data_type: TYPE_FP32 dims: [ {WIDTH} ] }} ]\n'
    )
    models, _ = load()
    served = models.get("m")
    assert served.metadata()["inputs"][0]["shape"] == [-1, WIDTH]
    assert served.config()["input"][0]["dims"] == [WIDTH]
    check_inputs(_one(), served.inputs)
    with pytest.raises(Refused, match=rf"shape \[1, {WIDTH + 1}\], expected FP32 with shape"):
        check_inputs({"x": np.zeros((1, WIDTH + 1), np.float32)}, served.inputs)


def test_backend_openvino_runs_a_plain_model_on_openvino(tmp_path, load) -> None:
    pytest.importorskip("openvino")
    _model(tmp_path, 'backend: "openvino"\ndefault_model_filename: "model.onnx"\n')
    models, row = load()
    assert row["state"] == READY, row
    assert models.get("m").session.get_providers() == ["OpenVINO:CPU"]
    assert models.get("m").config()["backend"] == "openvino"


def test_a_python_backend_model_is_reported_as_written(tmp_path, load) -> None:
    source = _write_model(tmp_path / "src" / "add.onnx")
    (tmp_path / "m/1").mkdir(parents=True)
    kiln.compile(str(source), tmp_path / "m/1/artifact.kiln", rounds=0)
    (tmp_path / "m/config.pbtxt").write_text('backend: "python"\nmax_batch_size: 8\n')
    shutil.rmtree(tmp_path / "src")
    models, row = load()
    assert row["state"] == READY, row
    config = models.get("m").config()
    assert (config["platform"], config["backend"]) == ("", "python")
    assert models.get("m").metadata()["platform"] == ""


def test_a_model_on_two_engines_is_reported_as_kilns_runtime() -> None:
    assert _engine(["CPUExecutionProvider", "OpenVINO:CPU"])[:2] == ("", "kiln")
    assert _engine(["OpenVINO:CPU"])[:2] == ("openvino", "openvino")


# ---------------------------------------------------------------- refused


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ("version_policy: { all: {} }\n", ["version_policy all", "picks versions 2, 1"]),
        ("version_policy: { specific: { versions: [7] } }\n", ["picks none", "(2, 1)"]),
        ('backend: "tensorrt"\n', ["backend 'tensorrt'", "tritonserver"]),
        ('platform: "pytorch_libtorch"\n', ["platform 'pytorch_libtorch'"]),
        ("sequence_batching { }\n", ["sequence_batching", "remove it"]),
        ('name: "other"\n', ["name 'other'", "folder 'm'"]),
        ("max_batch_size: 0\ndynamic_batching { }\n", ["dynamic_batching needs"]),
        ("max_batch_size: 4\ndynamic_batching { preferred_batch_size: [8] }\n",
         ["preferred_batch_size 8"]),
        ('input [ { name: "nope" data_type: TYPE_FP32 dims: [ 4 ] } ]\n', ["input 'nope'", "(x)"]),
        ('max_batch_size: 8\ninput [ { name: "x" data_type: TYPE_FP32 dims: [ 5 ] } ]\n',
         ["input 'x' dims [5]", "write dims: [4]"]),
        ('input [ { name: "x" data_type: TYPE_INT64 dims: [ 4 ] } ]\n', ["data_type TYPE_INT64"]),
        ("instance_group [ { kind: KIND_GPU } ]\n", ["KIND_GPU", "KIND_CPU"]),
        ("max_batch_size: nope\n", ["config.pbtxt", "ModelConfig text format"]),
    ],
)  # fmt: skip
def test_what_kiln_cannot_honour_is_refused_naming_the_field(tmp_path, load, config, words):
    _model(tmp_path, config, versions=(1, 2))
    _, row = load()
    _refused(row, str(tmp_path / "m"), *words)


def test_max_batch_size_on_a_model_without_a_batch_dim_is_refused(tmp_path, load) -> None:
    _model(tmp_path, "max_batch_size: 8\n", batched=False)
    _, row = load()
    _refused(row, "max_batch_size 8", "write max_batch_size: 0")


# ---------------------------------------------------------------- the index on every server


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Iterator:
    """`kiln serve add.onnx`: a server given a model file, no repository."""
    home = tmp_path_factory.mktemp("index-home")
    server = _start(home, str(_write_model(home / "add.onnx")))
    yield server
    _stop(server)


def test_a_server_given_files_answers_the_repository_index(plain) -> None:
    rows = triton_http.InferenceServerClient(plain.url).get_model_repository_index()
    assert rows == [{"name": "add", "version": "1", "state": READY, "reason": ""}]
    grpc = triton_grpc.InferenceServerClient(f"127.0.0.1:{plain.ready['grpc_port']}")
    (row,) = grpc.get_model_repository_index(as_json=True)["models"]
    assert (row["name"], row["state"]) == ("add", READY)
    with pytest.raises(Exception, match="--model-repository"):
        triton_http.InferenceServerClient(plain.url).load_model("add")
    # a load with a config override is told the same, not that the parameter is not taken
    with pytest.raises(Exception, match="--model-repository"):
        triton_http.InferenceServerClient(plain.url).load_model("add", config="{}")
    with pytest.raises(Exception, match="--model-repository"):
        grpc.load_model("add", config="{}")
