"""kiln.Session beside onnxruntime.InferenceSession on the same model file: what a user of the
one expects from the other (metadata, providers, run's arguments), and the clear refusals."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import kiln
from kiln import zoo
from kiln.errors import KilnError

RNG = np.random.default_rng(0)


@pytest.fixture(scope="module")
def bert_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("models") / "bert-tiny.onnx"
    onnx.save(zoo.build("bert-tiny"), path)
    return str(path)


@pytest.fixture(scope="module")
def pair(bert_file):
    """(kiln, ORT) sessions on the same file."""
    reference = ort.InferenceSession(bert_file, providers=["CPUExecutionProvider"])
    # Module-scoped, so built before the per-test KILN_HOME of conftest: give it its own.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KILN_HOME", str(Path(bert_file).parent / "home"))
        with kiln.Session(bert_file) as session:
            yield session, reference


def feeds(batch: int = 2, seq: int = 7) -> dict[str, np.ndarray]:
    return {
        "input_ids": RNG.integers(0, 1000, (batch, seq)).astype(np.int64),
        "attention_mask": np.ones((batch, seq), np.int64),
        "token_type_ids": np.zeros((batch, seq), np.int64),
    }


def described(args) -> list[tuple]:
    return [(a.name, a.type, a.shape) for a in args]


def assert_same_metadata(session: kiln.Session, reference: ort.InferenceSession) -> None:
    assert described(session.get_inputs()) == described(reference.get_inputs())
    assert described(session.get_outputs()) == described(reference.get_outputs())
    got, want = session.get_modelmeta(), reference.get_modelmeta()
    for field in (
        "producer_name",
        "graph_name",
        "domain",
        "description",
        "graph_description",
        "version",
        "custom_metadata_map",
    ):
        assert getattr(got, field) == getattr(want, field), field


def test_inputs_outputs_and_metadata_equal_onnxruntime(pair):
    session, reference = pair
    assert_same_metadata(session, reference)
    # Symbolic dims by name, fixed ones as ints, as ORT reports them.
    assert session.get_outputs()[0].shape == ["batch", "seq", 64]
    assert session.get_inputs()[0].type == "tensor(int64)"
    assert session.get_modelmeta().custom_metadata_map["kiln.zoo"] == "bert-tiny"
    assert session.get_providers() == reference.get_providers() == ["CPUExecutionProvider"]
    assert [v.name for v in session.interface.graph.inputs] == session.input_names


@pytest.mark.parametrize(
    "names", [None, [], ["pooler_output"], ("last_hidden_state", "pooler_output")]
)
def test_run_outputs_equal_onnxruntime(pair, names):
    session, reference = pair
    given = feeds()
    got = session.run(names, given)
    want = reference.run(list(names) if names is not None else None, given)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_run_refuses_what_onnxruntime_users_get_wrong(pair):
    session, _ = pair
    with pytest.raises(
        KilnError, match=r"not the string 'pooler_output'; pass \['pooler_output'\]"
    ):
        session.run("pooler_output", feeds())
    with pytest.raises(KilnError, match="feeds must be a dict of input name -> numpy array.*None"):
        session.run(None, None)
    with pytest.raises(KilnError, match="feeds must be a dict.*'input_ids'.*got a list"):
        session.run(None, list(feeds().values()))
    with pytest.raises(KilnError, match="must be a dict.*got a list"):
        session.run_batch([list(feeds().values())])
    with pytest.raises(KilnError, match="unknown output 'logits'"):
        session.run(["logits"], feeds())


def test_artifact_metadata_equals_onnxruntime_on_its_model(tmp_path, bert_file):
    artifact = kiln.compile(bert_file, tmp_path / "bert.kiln", rounds=0)
    reference = ort.InferenceSession(str(artifact.model_path), providers=["CPUExecutionProvider"])
    with kiln.Session(artifact.path) as session:
        assert_same_metadata(session, reference)
        given = feeds(1, 5)
        for g, w in zip(session.run(None, given), reference.run(None, given), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)


def test_openvino_names_its_device_as_the_provider(bert_file):
    pytest.importorskip("openvino")
    reference = ort.InferenceSession(bert_file, providers=["CPUExecutionProvider"])
    with kiln.Session(bert_file, backend="openvino") as session:
        assert session.get_providers() == ["OpenVINO:CPU"]
        assert described(session.get_inputs()) == described(reference.get_inputs())


def test_options_are_one_explicit_dict(bert_file):
    with kiln.Session(bert_file, options={"intra_op_threads": 1}) as session:
        assert session.executable.options.intra_op_threads == 1
    with pytest.raises(KilnError, match="unknown option 'threads'.*'intra_op_threads'"):
        kiln.Session(bert_file, options={"threads": 1})
    with pytest.raises(TypeError):
        kiln.Session(bert_file, intra_op_threads=1)  # not a keyword of its own


def string_model(path: Path) -> str:
    """Text in, text out: an upper-cased 1-D input, a 2-D one with an unknown dim passed
    through, and a float input declared without a shape."""
    text = helper.make_tensor_value_info("text", TensorProto.STRING, ["n"])
    words = helper.make_tensor_value_info("words", TensorProto.STRING, ["rows", None])
    scale = helper.make_tensor_value_info("scale", TensorProto.FLOAT, None)
    outputs = [
        helper.make_tensor_value_info("upper", TensorProto.STRING, ["n"]),
        helper.make_tensor_value_info("words_out", TensorProto.STRING, ["rows", None]),
        helper.make_tensor_value_info("scale_out", TensorProto.FLOAT, None),
    ]
    nodes = [
        # locale "C": the default (en_US.UTF-8) is missing on minimal systems.
        helper.make_node(
            "StringNormalizer", ["text"], ["upper"], case_change_action="UPPER", locale="C"
        ),
        helper.make_node("Identity", ["words"], ["words_out"]),
        helper.make_node("Identity", ["scale"], ["scale_out"]),
    ]
    graph = helper.make_graph(nodes, "strings", [text, words, scale], outputs)
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="tests"
    )
    model.ir_version, model.model_version, model.doc_string = 8, 3, "strings for tests"
    onnx.save(model, path / "strings.onnx")
    return str(path / "strings.onnx")


def test_numpy_text_is_accepted_for_string_inputs(tmp_path):
    path = string_model(tmp_path)
    reference = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    unicode = {
        "text": np.array(["ab", "Cd", "ef"]),  # dtype '<U2', as numpy makes from str
        "words": np.array([["x", "yy"], ["z", ""]]),
        "scale": np.array(2.0, np.float32),
    }
    as_objects = {n: a.astype(object) if a.dtype.kind == "U" else a for n, a in unicode.items()}
    with kiln.Session(path) as session:
        assert_same_metadata(session, reference)
        assert session.get_inputs()[1].shape == ["rows", None]
        assert session.get_inputs()[2].shape == []
        got = session.run(None, unicode)
        want = reference.run(None, as_objects)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape
            np.testing.assert_array_equal(g, w)
        assert got[0].tolist() == ["AB", "CD", "EF"]
        assert [o[1].tolist() for o in session.run_batch([unicode, as_objects])] == [
            [["x", "yy"], ["z", ""]]
        ] * 2
        with pytest.raises(KilnError, match="input 'scale' has dtype <U1"):
            session.run(None, {**unicode, "scale": np.array("2")})  # text where a float goes


def test_onnxruntime_constructor_arguments_are_taken(bert_file):
    """The first line of most ONNX Runtime code, with kiln.Session in place of
    InferenceSession: positional sess_options, providers, run_options."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    reference = ort.InferenceSession(bert_file, so, providers=["CPUExecutionProvider"])
    with kiln.Session(bert_file, so, ["CPUExecutionProvider"]) as session:
        assert session.options["intra_op_threads"] == 1
        assert session.options["optimization"] == "basic"
        assert session.options["inter_op_threads"] == 0  # left at ORT's default: Kiln's own
        assert session.get_providers() == reference.get_providers()
        given = feeds()
        got = session.run(None, given, ort.RunOptions())
        for g, w in zip(got, reference.run(None, given, ort.RunOptions()), strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
        stop = ort.RunOptions()
        stop.terminate = True
        with pytest.raises(KilnError, match="run_options.terminate"):
            session.run(None, given, stop)
        with pytest.raises(KilnError, match="run_options must be an onnxruntime.RunOptions"):
            session.run(None, given, {"terminate": True})
    # As ONNX Runtime does, the first provider it can run is used.
    with pytest.warns(UserWarning, match="CUDAExecutionProvider"):
        session = kiln.Session(
            bert_file, providers=["CUDAExecutionProvider", "CPUExecutionProvider"]
        )
    with session:
        assert session.get_providers() == ["CPUExecutionProvider"]


def test_onnxruntime_arguments_kiln_cannot_honour_are_refused(bert_file):
    with pytest.raises(KilnError, match=r"none of the providers \['TensorrtExecutionProvider'\]"
                       r".*CPUExecutionProvider.*OpenVINOExecutionProvider"):  # fmt: skip
        kiln.Session(bert_file, providers=["TensorrtExecutionProvider"])
    with pytest.raises(KilnError, match="providers must be a list"):
        kiln.Session(bert_file, providers="CPUExecutionProvider")
    with pytest.raises(KilnError, match="backend 'ort'.*backend='openvino'"):
        kiln.Session(bert_file, providers=["CPUExecutionProvider"], backend="openvino")
    with pytest.raises(KilnError, match="provider options.*options="):
        kiln.Session(bert_file, providers=[("CPUExecutionProvider", {"arena": "1"})])
    with pytest.raises(KilnError, match="provider_options are not taken"):
        kiln.Session(bert_file, None, ["CPUExecutionProvider"], [{"arena": "1"}])
    profiling = ort.SessionOptions()
    profiling.enable_profiling = True
    with pytest.raises(KilnError, match="enable_profiling.*kiln profile"):
        kiln.Session(bert_file, profiling)
    layout = ort.SessionOptions()
    layout.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_LAYOUT
    with pytest.raises(KilnError, match="ORT_ENABLE_LAYOUT is not supported; use one of"):
        kiln.Session(bert_file, layout)
    with pytest.raises(KilnError, match="sess_options must be an onnxruntime.SessionOptions"):
        kiln.Session(bert_file, {"intra_op_num_threads": 1})


def test_openvino_provider_picks_openvino(bert_file):
    pytest.importorskip("openvino")
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    with kiln.Session(bert_file, so, providers=["OpenVINOExecutionProvider"]) as session:
        assert session.get_providers() == ["OpenVINO:CPU"]
        assert session.options["inference_num_threads"] == 1
    parallel = ort.SessionOptions()
    parallel.inter_op_num_threads = 2
    with pytest.raises(KilnError, match="inter_op_num_threads = 2 has no equivalent.*openvino"):
        kiln.Session(bert_file, parallel, providers=["OpenVINOExecutionProvider"])


def test_the_signature_shows_the_real_parameters():
    import inspect

    from kiln.runtime import LocalSession, Session

    parameters = inspect.signature(Session).parameters
    assert list(parameters)[:4] == [
        "path_or_model",
        "sess_options",
        "providers",
        "provider_options",
    ]
    assert {"backend", "buckets", "options", "keep_requests", "remote"} <= set(parameters)
    assert "run_options" in inspect.signature(LocalSession.run).parameters
    # kiln.Session: the runtime's parameters, the same defaults, and the feedback loop's
    top = inspect.signature(kiln.Session).parameters
    assert list(top) == [*parameters, "feedback", "feedback_options"]
    for name, parameter in parameters.items():
        assert (top[name].kind, top[name].default) == (parameter.kind, parameter.default), name


def test_a_model_run_here_is_a_local_session(pair):
    from kiln.runtime import LocalSession, SessionLike

    session, _ = pair
    assert isinstance(session, LocalSession) and isinstance(session, SessionLike)
    assert session.feedback is None


def test_axes_an_exporter_names_unknown_are_independent(tmp_path) -> None:
    # paddle2onnx names every free axis "?" (PP-OCR's classifier: height and width): as
    # onnxruntime does, Kiln takes them as unrelated sizes, not one shared dim.
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 3, "?", "?"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 3, "?", "?"])],
    )  # fmt: skip
    path = tmp_path / "unknown.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    x = RNG.standard_normal((2, 3, 48, 192)).astype(np.float32)
    with kiln.Session(str(path)) as session:
        (y,) = session.run(None, {"x": x})
    np.testing.assert_array_equal(y, np.maximum(x, 0))
