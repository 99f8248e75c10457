"""Real trained models from a PyPI wheel (PP-OCRv4 in rapidocr-onnxruntime, Apache-2.0): Kiln
compiles them verified, with the shapes they need. Skipped when the package is absent
(`pip install --no-deps rapidocr-onnxruntime` brings just the models)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

import kiln

# Located, not imported: the package's own code needs OpenCV, which Kiln's tests do not.
_SPEC = importlib.util.find_spec("rapidocr_onnxruntime")
if _SPEC is None or not _SPEC.submodule_search_locations:
    pytest.skip("rapidocr-onnxruntime is not installed", allow_module_level=True)
MODELS = Path(next(iter(_SPEC.submodule_search_locations))) / "models"


@pytest.mark.parametrize(
    ("file", "shapes", "feed_shape"),
    [
        ("ch_PP-OCRv4_det_infer.onnx", None, (1, 3, 224, 224)),
        ("ch_PP-OCRv4_rec_infer.onnx", {"x": (1, 3, 48, 320)}, (1, 3, 48, 320)),
        ("ch_ppocr_mobile_v2.0_cls_infer.onnx", None, (1, 3, 224, 224)),
    ],
)
def test_ppocr_models_compile_verified_and_match(file, shapes, feed_shape, tmp_path):
    import onnxruntime as ort

    source = MODELS / file
    artifact = kiln.compile(source, tmp_path / "m.kiln", shapes=shapes)
    assert artifact.manifest["verification"]["ok"]
    assert artifact.manifest["dropped_passes"] == []
    x = np.random.default_rng(0).random(feed_shape, dtype=np.float32)
    want = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    got = kiln.Session(artifact.path).run(None, {"x": x})
    for w, g in zip(want, got, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-4 * max(1.0, float(np.abs(w).max())))


def test_rec_model_without_shape_says_what_to_give(tmp_path):
    with pytest.raises(kiln.KilnError, match=r"Give input shapes with --shape INPUT=D0xD1x"):
        kiln.compile(MODELS / "ch_PP-OCRv4_rec_infer.onnx", tmp_path / "m.kiln")
