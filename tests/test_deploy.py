"""`kiln export --triton`: Triton model repository entries, checked against Triton's own
ModelConfig schema (tritonclient's model_config_pb2, text-format parse) and the backends'
documented parameters. The real server runs the kiln-runtime form in test_triton_server.py."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from google.protobuf import text_format
from string_models import strings_model
from tritonclient.utils import np_to_triton_dtype

import kiln
from kiln.deploy import export_triton, pbtxt
from kiln.deploy.config import DEFAULT_MAX_BATCH
from kiln.errors import KilnError
from kiln.hardware import cpu_info
from kiln.ir.inputs import synthesize

BERT, RESNET = "bert-tiny", "resnet-tiny"
ORT_OPTIONS = {"optimization": "basic", "intra_op_threads": 1, "inter_op_threads": 2,
               "execution_mode": "parallel", "memory_arena": False, "spinning": False}  # fmt: skip
OV_OPTIONS = {"performance_hint": "THROUGHPUT", "num_streams": 2, "inference_num_threads": 1}
TUNED = {"max_batch": 4, "max_delay_ms": 2.5}
SCHEMA = pbtxt.model_config_schema()  # Triton's ModelConfig; tritonclient is a test dependency


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> dict[str, Path]:
    """Tiny zoo artifacts, compiled once: bert-tiny on ORT with engine settings and a tuned
    batcher, resnet-tiny on ORT with defaults and on OpenVINO, a model of strings."""
    where = tmp_path_factory.mktemp("deploy")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KILN_HOME", str(where / "home"))
        bert = kiln.compile(f"zoo:{BERT}", where / "bert.kiln", engine_options=ORT_OPTIONS)
        resnet = kiln.compile(f"zoo:{RESNET}", where / "resnet.kiln")
        openvino = kiln.compile(f"zoo:{RESNET}", where / "resnet-ov.kiln", backend="openvino",
                                engine_options=OV_OPTIONS)  # fmt: skip
        strings = kiln.compile(strings_model(where / "strings.onnx"), where / "strings.kiln")
    _set_tuned_batcher(bert.path, TUNED)
    paths = {"bert": bert.path, "resnet": resnet.path, "openvino": openvino.path}
    return paths | {"strings": strings.path}


def _set_tuned_batcher(artifact: Path, serving: dict[str, Any]) -> None:
    """What `kiln tune --clients` records for kiln serve, in the manifest."""
    manifest = artifact / "manifest.json"
    data = json.loads(manifest.read_text())
    data["benchmark"] = {"tune": {"serving": serving}}
    manifest.write_text(json.dumps(data))


def _parsed(path: Path) -> Any:
    """config.pbtxt as Triton's ModelConfig message: text_format refuses an unknown field,
    a wrong type or an unknown enum value."""
    return text_format.Parse(path.read_text(), SCHEMA())


def _params(config: Any) -> dict[str, str]:
    return {key: value.string_value for key, value in config.parameters.items()}


def _model_tensors(artifact: Path, batched: bool) -> dict[str, list[tuple[str, str, list]]]:
    """What Triton's config must say of the model's own inputs and outputs: dtypes named by
    tritonclient, the batch dim left out, -1 for a dynamic dim."""
    graph = onnx.load(artifact / "model.onnx", load_external_data=False).graph
    given = {i.name for i in graph.initializer}

    def tensors(values) -> list[tuple[str, str, list]]:
        out = []
        for value in values:
            kind = value.type.tensor_type
            dtype = onnx.helper.tensor_dtype_to_np_dtype(kind.elem_type)
            dims = [d.dim_value if d.HasField("dim_value") else -1 for d in kind.shape.dim]
            out.append((value.name, f"TYPE_{np_to_triton_dtype(dtype)}", dims[1:] if batched
                        else dims))  # fmt: skip
        return out

    return {"input": tensors(v for v in graph.input if v.name not in given),
            "output": tensors(graph.output)}  # fmt: skip


def _tensors(config: Any, key: str) -> list[tuple[str, str, list]]:
    kinds = type(config).DESCRIPTOR.fields_by_name[key].message_type.fields_by_name["data_type"]
    return [(t.name, kinds.enum_type.values_by_number[t.data_type].name, list(t.dims))
            for t in getattr(config, key)]  # fmt: skip


# ---------------------------------------------------------------- native


def test_native_onnxruntime_config_carries_what_kiln_decided(artifacts, tmp_path):
    done = export_triton(artifacts["bert"], tmp_path / "repo", name="bert")
    assert (done.version_path / "model.onnx").read_bytes() == (
        artifacts["bert"] / "model.onnx"
    ).read_bytes()
    config = _parsed(done.path / "config.pbtxt")
    assert (config.name, config.platform, config.backend) == (
        "bert", "onnxruntime_onnx", "onnxruntime"
    )  # fmt: skip
    expected = _model_tensors(artifacts["bert"], batched=True)
    assert _tensors(config, "input") == expected["input"]
    assert _tensors(config, "output") == expected["output"]
    assert config.max_batch_size == TUNED["max_batch"]
    assert config.dynamic_batching.max_queue_delay_microseconds == TUNED["max_delay_ms"] * 1000
    assert [g.kind for g in config.instance_group] == [type(config.instance_group[0]).KIND_CPU]
    assert config.optimization.graph.level == -1  # basic, in the onnxruntime backend's scale
    assert _params(config) == {
        "intra_op_thread_count": str(ORT_OPTIONS["intra_op_threads"]),
        "inter_op_thread_count": str(ORT_OPTIONS["inter_op_threads"]),
        "execution_mode": "1", "enable_mem_arena": "0", "enable_mem_pattern": "1",
    }  # fmt: skip
    assert any("spinning" in note for note in done.notes)  # no backend parameter: said
    warmup = config.model_warmup[0]
    seq = json.loads((artifacts["bert"] / "manifest.json").read_text())["dims"]["seq"]
    assert {k: list(v.dims) for k, v in warmup.inputs.items()} == {
        name: [seq] for name, _, _ in expected["input"]
    }
    assert all(v.zero_data for v in warmup.inputs.values()) and warmup.batch_size == 1


def test_native_defaults_leave_the_backend_defaults_and_no_delay(artifacts, tmp_path):
    done = export_triton(artifacts["resnet"], tmp_path / "repo")
    config = _parsed(done.path / "config.pbtxt")
    assert done.name == "resnet" and config.max_batch_size == DEFAULT_MAX_BATCH
    assert config.HasField("dynamic_batching")
    assert config.dynamic_batching.max_queue_delay_microseconds == 0  # lone requests run at once
    assert not config.optimization.HasField("graph")  # ORT_ENABLE_ALL: the backend's default
    # Threads left to ORT: the count the InferenceService's cpu asks for, not 0 (which in a
    # pod is one thread per core of the node).
    assert _params(config)["intra_op_thread_count"] == str(cpu_info().physical_cores)
    assert not done.notes


def test_openvino_threads_left_to_the_engine_are_named(artifacts, tmp_path):
    artifact = shutil.copytree(artifacts["openvino"], tmp_path / "ov-default.kiln")
    manifest = json.loads((artifact / "manifest.json").read_text())
    del manifest["backend"]["options"]["inference_num_threads"]
    (artifact / "manifest.json").write_text(json.dumps(manifest))
    config = _parsed(export_triton(artifact, tmp_path / "repo").path / "config.pbtxt")
    assert _params(config)["INFERENCE_NUM_THREADS"] == str(cpu_info().physical_cores)


def test_native_config_says_what_onnx_runtime_must_read(artifacts, tmp_path):
    done = export_triton(artifacts["bert"], tmp_path / "repo")
    model = onnx.load(artifacts["bert"] / "model.onnx", load_external_data=False)
    opsets = ", ".join(f"{o.domain or 'ai.onnx'} {o.version}"
                       for o in sorted(model.opset_import, key=lambda o: o.domain))  # fmt: skip
    ort = importlib.metadata.version("onnxruntime")
    assert f"IR version {model.ir_version}, opsets {opsets}" in done.requires
    assert f"onnxruntime {ort}" in done.requires
    text = (done.path / "config.pbtxt").read_text()
    assert f"# Requires: {done.requires}." in text
    assert not export_triton(artifacts["bert"], tmp_path / "k", runtime="kiln").requires


def test_native_openvino_config_names_its_documented_parameters(artifacts, tmp_path):
    done = export_triton(artifacts["openvino"], tmp_path / "repo")
    config = _parsed(done.path / "config.pbtxt")
    assert config.backend == "openvino" and not config.platform
    assert config.default_model_filename == "model.onnx"
    assert (done.version_path / config.default_model_filename).is_file()
    assert _params(config) == {
        "PERFORMANCE_HINT": OV_OPTIONS["performance_hint"],
        "NUM_STREAMS": str(OV_OPTIONS["num_streams"]),
        "INFERENCE_NUM_THREADS": str(OV_OPTIONS["inference_num_threads"]),
    }
    assert any("f32" in note for note in done.notes)  # no f32 hint in the backend: said
    text = (done.path / "config.pbtxt").read_text()
    assert all(f"# Note: {note}." in text for note in done.notes)


def test_a_model_without_a_batch_dim_is_not_batched_and_text_has_no_warmup(artifacts, tmp_path):
    done = export_triton(artifacts["strings"], tmp_path / "repo")
    config = _parsed(done.path / "config.pbtxt")
    assert config.max_batch_size == 0 and not config.HasField("dynamic_batching")
    assert _tensors(config, "input") == [("text", "TYPE_STRING", [-1])]
    assert not config.model_warmup and any("warmup" in note for note in done.notes)


@pytest.mark.parametrize("which", ["bert", "openvino", "strings"])
@pytest.mark.parametrize("runtime", ["native", "kiln"])
def test_without_tritonclient_the_same_config_is_written(artifacts, tmp_path, monkeypatch,
                                                         which, runtime):  # fmt: skip
    with_schema = export_triton(artifacts[which], tmp_path / "a", runtime=runtime)
    monkeypatch.setattr(pbtxt, "model_config_schema", lambda: None)
    without = export_triton(artifacts[which], tmp_path / "b", runtime=runtime)
    assert _parsed(without.path / "config.pbtxt") == _parsed(with_schema.path / "config.pbtxt")


# ---------------------------------------------------------------- kiln runtime


def test_kiln_runtime_layout_is_a_python_model_serving_a_copy_of_the_artifact(artifacts, tmp_path):
    done = export_triton(artifacts["bert"], tmp_path / "repo", runtime="kiln", version=3)
    assert done.version_path == tmp_path / "repo" / "bert" / "3"
    model_py = done.version_path / "model.py"
    template = Path(kiln.deploy.__file__).with_name("python_model.py")
    assert model_py.read_text() == template.read_text()
    copy = done.version_path / "artifact.kiln"
    assert sorted(p.name for p in copy.iterdir()) == sorted(
        p.name for p in artifacts["bert"].iterdir()
    )
    config = _parsed(done.path / "config.pbtxt")
    assert config.backend == "python" and not config.platform
    assert config.max_batch_size == TUNED["max_batch"] and not config.parameters
    expected = _model_tensors(artifacts["bert"], batched=True)
    assert _tensors(config, "input") == expected["input"]


class _FakeTensor:
    def __init__(self, name: str, array: np.ndarray) -> None:
        self._name, self._array = name, array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class _FakeRequest:
    def __init__(self, feeds: dict[str, np.ndarray], outputs: tuple[str, ...] = ()) -> None:
        self.tensors = {name: _FakeTensor(name, a) for name, a in feeds.items()}
        self.outputs = list(outputs)

    def requested_output_names(self) -> list[str]:
        return self.outputs


class _FakeResponse:
    def __init__(self, output_tensors: list[_FakeTensor], error: Exception | None = None):
        self.tensors = {t.name(): t.as_numpy() for t in output_tensors}
        self.error = error


class _FakeTritonError(Exception):
    """pb_utils.TritonError as Triton 23.09 and later have it: a message and a code."""

    INTERNAL, INVALID_ARG = 1, 3

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        super().__init__(message)
        self.code = code


def _fake_pb_utils() -> types.ModuleType:
    """The few names of Triton's triton_python_backend_utils that model.py uses."""
    module = types.ModuleType("triton_python_backend_utils")
    module.Tensor = _FakeTensor
    module.InferenceResponse = _FakeResponse
    module.TritonError = _FakeTritonError
    module.get_input_tensor_by_name = lambda request, name: request.tensors.get(name)
    return module


def _bert_feeds(batch: int, seq: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(0, 1000, (batch, seq)).astype(np.int64),
            "attention_mask": np.ones((batch, seq), np.int64),
            "token_type_ids": np.zeros((batch, seq), np.int64)}  # fmt: skip


def _python_model(done: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The exported model.py's model, initialized as Triton's Python backend does."""
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", _fake_pb_utils())
    spec = importlib.util.spec_from_file_location("exported_model", done.version_path / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model = module.TritonPythonModel()
    model.initialize({"model_config": json.dumps(done.config), "model_version": str(done.version),
                      "model_repository": str(done.path)})  # fmt: skip
    return model


def test_the_python_model_answers_each_request_as_kiln_session_does(artifacts, tmp_path,
                                                                    monkeypatch):  # fmt: skip
    done = export_triton(artifacts["bert"], tmp_path / "repo", runtime="kiln")
    model = _python_model(done, monkeypatch)
    session = kiln.Session(artifacts["bert"])
    good = [_bert_feeds(*shape, seed=i) for i, shape in enumerate([(1, 8), (2, 8), (1, 12)])]
    too_long = _bert_feeds(1, 4096, seed=3)
    bad_ids = _bert_feeds(1, 8, seed=4)
    bad_ids["token_type_ids"][:] = 7  # past the token-type table: the engine fails on it
    requests = [_FakeRequest(good[0]), _FakeRequest(too_long), _FakeRequest(bad_ids),
                _FakeRequest(good[1], ("pooler_output",)), _FakeRequest(good[2])]  # fmt: skip
    answers = model.execute(requests)
    assert "at most seq=" in str(answers[1].error)  # refused alone, with Kiln's reason
    assert "token_type" in str(answers[2].error)  # failed alone; its neighbours still answered
    # Both the client's mistakes: Triton answers them 400 / INVALID_ARGUMENT, as kiln serve.
    assert answers[1].error.code == answers[2].error.code == _FakeTritonError.INVALID_ARG
    assert set(answers[3].tensors) == {"pooler_output"}  # the outputs asked for
    for feeds, answer in zip(good, [answers[0], answers[3], answers[4]], strict=True):
        assert answer.error is None
        want = dict(zip(session.output_names, session.run(None, feeds), strict=True))
        for name, got in answer.tensors.items():
            np.testing.assert_allclose(got, want[name], rtol=1e-5, atol=1e-6)
    model.finalize()


def test_a_partitioned_artifact_runs_whole_in_the_python_model(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    parts = kiln.compile(
        "zoo:two-tower-tiny", tmp_path / "tt.kiln", partition="text=ort", rounds=0
    ).path
    with pytest.raises(KilnError, match="partitioned artifact .*--runtime kiln"):
        export_triton(parts, tmp_path / "repo")  # a native backend runs one graph
    assert not (tmp_path / "repo").exists()
    done = export_triton(parts, tmp_path / "repo", runtime="kiln")
    session = kiln.Session(parts)
    config = _parsed(done.path / "config.pbtxt")
    assert config.backend == "python" and config.max_batch_size == DEFAULT_MAX_BATCH
    assert [t.name for t in config.input] == session.input_names
    assert [t.name for t in config.output] == session.output_names
    copy = done.version_path / "artifact.kiln"
    assert _tree(copy / "parts") == _tree(parts / "parts")
    model = _python_model(done, monkeypatch)
    feeds = synthesize(session.interface, dims=session.artifact.manifest.dims)
    (answer,) = model.execute([_FakeRequest(feeds)])
    assert answer.error is None
    for name, want in zip(session.output_names, session.run(None, feeds), strict=True):
        np.testing.assert_array_equal(answer.tensors[name], want)
    model.finalize()


# ---------------------------------------------------------------- bad input


def _kiln(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln", *args], cwd=cwd, capture_output=True,
                          text=True)  # fmt: skip


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


BAD = [
    ({"artifact": "not-there.kiln"}, "not a Kiln artifact"),
    ({"name": "../escape"}, "model name '../escape'"),
    ({"name": "a/b"}, "model name 'a/b'"),
    ({"name": ".hidden"}, "model name '.hidden'"),
    ({"name": ""}, "model name ''"),
    ({"version": 0}, "version 0"),
    ({"runtime": "tensorrt"}, "unknown runtime 'tensorrt'"),
    ({"name": "taken"}, "already has version 1"),
    ({"name": "taken", "runtime": "kiln"}, "already has version 1"),
]


def _occupied_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "taken" / "1").mkdir(parents=True)
    (repo / "taken" / "1" / "model.onnx").write_bytes(b"the user's")
    return repo


@pytest.mark.parametrize(("given", "message"), BAD)
def test_bad_input_is_refused_naming_it_and_nothing_is_written(artifacts, tmp_path, given,
                                                               message):  # fmt: skip
    repo = _occupied_repo(tmp_path)
    before = _tree(repo)
    given = {"artifact": artifacts["resnet"], **given}
    with pytest.raises(KilnError, match=re.escape(message)):
        export_triton(given.pop("artifact"), repo, **given)
    assert _tree(repo) == before  # no temporary directory left either


@pytest.mark.parametrize(("args", "message"), [
    (["ARTIFACT", "--name", "a/b"], "model name 'a/b'"),
    (["ARTIFACT", "--name", "taken"], "already has version 1"),
])  # fmt: skip
def test_the_cli_says_bad_input_in_one_line_with_exit_2(artifacts, tmp_path, args, message):
    repo = _occupied_repo(tmp_path)
    before = _tree(repo)
    args = [str(artifacts["resnet"]) if a == "ARTIFACT" else a for a in args]
    done = _kiln("export", *args, "--triton", str(repo), cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert _tree(repo) == before


def test_no_destination_and_a_file_as_repository_are_refused(artifacts, tmp_path):
    done = _kiln("export", str(artifacts["resnet"]), cwd=tmp_path)
    assert done.returncode == 2 and "--triton REPO" in done.stderr
    (tmp_path / "file").write_text("")
    with pytest.raises(KilnError, match="not a directory"):
        export_triton(artifacts["resnet"], tmp_path / "file")
    with pytest.raises(KilnError, match="does not exist"):
        export_triton(artifacts["resnet"], tmp_path / "missing" / "repo")
    assert not (tmp_path / "missing").exists()


def test_force_replaces_a_version_and_new_versions_sit_beside_it(artifacts, tmp_path):
    repo = tmp_path / "repo"
    export_triton(artifacts["resnet"], repo, name="m")
    export_triton(artifacts["resnet"], repo, name="m", version=2)
    stale = repo / "m" / "1" / "stale.txt"
    stale.write_text("")
    done = export_triton(artifacts["resnet"], repo, name="m", force=True)
    assert not stale.exists() and (done.version_path / "model.onnx").is_file()
    assert _tree(repo / "m") == ["1", "1/model.onnx", "2", "2/model.onnx", "config.pbtxt"]


def test_switching_the_backend_under_other_versions_is_refused(artifacts, tmp_path):
    repo = tmp_path / "repo"
    export_triton(artifacts["resnet"], repo, name="m")
    config = (repo / "m" / "config.pbtxt").read_text()
    with pytest.raises(KilnError, match='backend \\("onnxruntime" here, "python" for this'):
        export_triton(artifacts["resnet"], repo, name="m", version=2, runtime="kiln")
    assert (repo / "m" / "config.pbtxt").read_text() == config and not (repo / "m" / "2").exists()


def test_a_version_whose_config_would_differ_is_refused_naming_the_fields(artifacts, tmp_path):
    repo = tmp_path / "repo"
    export_triton(artifacts["resnet"], repo, name="m")
    config = (repo / "m" / "config.pbtxt").read_text()
    with pytest.raises(KilnError) as refused:  # another model, and another tuned batcher
        export_triton(artifacts["bert"], repo, name="m", version=2)
    said = str(refused.value)
    assert "max_batch_size (16 here, 4 for this version)" in said
    for field in ("input", "output", "dynamic_batching", "parameters"):
        assert f"; {field}" in said
    assert "--name" in said and "--force" in said
    assert (repo / "m" / "config.pbtxt").read_text() == config and not (repo / "m" / "2").exists()
    export_triton(artifacts["resnet"], repo, name="m", version=2)  # the same config: taken
    assert (repo / "m" / "config.pbtxt").read_text() == config  # v1's, header and all
    done = export_triton(artifacts["bert"], repo, name="m", version=3, force=True)
    assert _parsed(repo / "m" / "config.pbtxt").max_batch_size == done.config["max_batch_size"]


def test_cli_json_says_what_was_written(artifacts, tmp_path):
    done = _kiln("export", str(artifacts["bert"]), "--triton", "repo", "--runtime", "kiln",
                 "--json", cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout)
    assert (said["model"], said["version"], said["runtime"], said["backend"]) == (
        "bert", 1, "kiln", "python"
    )  # fmt: skip
    assert Path(tmp_path, said["path"], "1", "model.py").is_file()
    assert said["config"]["max_batch_size"] == TUNED["max_batch"]
