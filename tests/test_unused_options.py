"""Options given and not used are said, in the manifest and on the CLI: an option that
silently does nothing reads as one that worked."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

import kiln
from kiln import zoo


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    path = tmp_path_factory.mktemp("m") / "bert.onnx"
    ir.save(ir.serde.deserialize_model(zoo.build("bert-tiny")), path)
    return path


def samples(model_path, count: int, stacked: bool):
    model = ir.load(model_path)
    from kiln.ir.inputs import synthesize

    sets = [synthesize(model, seed=i) for i in range(count)]
    if not stacked:
        return sets[0]
    return {name: np.stack([s[name] for s in sets]) for name in sets[0]}


def test_calibration_options_at_fp32_are_named_unused(bert, tmp_path):
    np.savez(tmp_path / "calib.npz", **samples(bert, 3, stacked=True))
    artifact = kiln.compile(bert, tmp_path / "a.kiln", calib=str(tmp_path / "calib.npz"),
                            calib_method="entropy", block_size=64, metric="top1",
                            rounds=0)  # fmt: skip
    notes = " | ".join(artifact.manifest.notes)
    for option in ("--calib ", "--calib-method", "--block-size", "--metric/--max-drop"):
        assert f"{option} not used" in notes or f"{option}not used" in notes, notes


def test_dynamic_int8_says_calib_method_is_unused_and_counts_the_samples(bert, tmp_path):
    np.savez(tmp_path / "calib.npz", **samples(bert, 3, stacked=True))
    artifact = kiln.compile(bert, tmp_path / "a.kiln", precision="int8",
                            calib=str(tmp_path / "calib.npz"), calib_method="entropy",
                            rounds=0)  # fmt: skip
    notes = " | ".join(artifact.manifest.notes)
    assert "--calib-method not used" in notes and "dynamic" in notes, notes
    assert "3 samples" in notes, notes


def test_a_one_sample_calibration_file_says_how_it_was_read(bert, tmp_path):
    np.savez(tmp_path / "one.npz", **samples(bert, 1, stacked=False))
    artifact = kiln.compile(bert, tmp_path / "a.kiln", precision="int8",
                            calib=str(tmp_path / "one.npz"), rounds=0)  # fmt: skip
    notes = " | ".join(artifact.manifest.notes)
    assert "1 sample (arrays of the inputs' own rank are one sample" in notes, notes


def test_int4_without_matmul_weights_says_there_is_nothing_to_quantize(tmp_path):
    # Convolutions only: int4 packs MatMul (and constant-weight Gemm) weights, none here.
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weight = np.random.default_rng(0).standard_normal((4, 3, 3, 3)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"]), helper.make_node("Relu", ["c"], ["y"])],
        "convs", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 6, 6])],
        [numpy_helper.from_array(weight, "w")],
    )  # fmt: skip
    model = tmp_path / "convs.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), model)
    with pytest.raises(kiln.KilnError, match="no layer int4 quantizes") as info:
        kiln.compile(model, tmp_path / "r.kiln", precision="int4", rounds=0)
    assert "drift" not in str(info.value)
    assert not (tmp_path / "r.kiln").exists()
