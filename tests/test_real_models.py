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
    artifact = kiln.compile(source, tmp_path / "m.kiln", shapes=shapes, rounds=0)
    assert artifact.manifest.verification.ok
    assert artifact.manifest.dropped_passes == []
    x = np.random.default_rng(0).random(feed_shape, dtype=np.float32)
    want = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    got = kiln.Session(artifact.path).run(None, {"x": x})
    for w, g in zip(want, got, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-3, atol=1e-4 * max(1.0, float(np.abs(w).max())))


def test_an_openvino_session_answers_right_after_a_shape_its_model_cannot_take(tmp_path):
    # The recogniser cannot run at 224x224 (its height must be 48): OpenVINO refuses it, and the
    # request that refused it answers NaN at every shape after. A session opening warms up at
    # such a synthesized shape, so without care every answer of it was NaN.
    import onnxruntime as ort

    source = MODELS / "ch_PP-OCRv4_rec_infer.onnx"
    artifact = kiln.compile(source, tmp_path / "m.kiln", backend="openvino",
                            shapes={"x": (1, 3, 48, 320)}, rounds=0)  # fmt: skip
    x = np.random.default_rng(0).random((2, 3, 48, 320), dtype=np.float32)
    want = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    session = kiln.Session(artifact.path)
    with pytest.raises(kiln.KilnError):
        session.run(None, {"x": np.zeros((1, 3, 224, 224), np.float32)})
    got = session.run(None, {"x": x})
    np.testing.assert_allclose(got[0], want[0], rtol=1e-3, atol=1e-4)


def test_rec_model_without_shape_is_fitted_by_the_ladder_and_says_so(tmp_path):
    # Its width is dynamic and the first guess (224) does not run; a rung of the ladder does.
    artifact = kiln.compile(MODELS / "ch_PP-OCRv4_rec_infer.onnx", tmp_path / "m.kiln", rounds=0)
    assert artifact.manifest.verification.ok
    assert any("found by trying" in note for note in artifact.manifest.notes)


_VOCABULARY = (
    "invoice total amount due date order number customer account paid balance shipping address "
    "street city north river market station garden kernel compiler tensor model quick brown fox "
    "jumps over lazy dog alpha beta gamma delta report summary page"
)
WORDS = _VOCABULARY.split()


def _text_lines(count: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    lines = []
    for _ in range(count):
        words = [str(w) for w in rng.choice(WORDS, size=int(rng.integers(2, 4)))]
        if rng.random() < 0.5:
            words.append(str(int(rng.integers(10, 99999))))
        lines.append(" ".join(words))
    return lines


def _render(line: str, seed: int) -> np.ndarray:
    """A text line as PP-OCR's recogniser wants it: 48 px high, padded to 320, in [-1, 1]."""
    from PIL import Image, ImageDraw, ImageFont

    rng = np.random.default_rng(seed)
    font = ImageFont.truetype(FONT, int(rng.integers(26, 34)))
    left, top, right, bottom = font.getbbox(line)
    image = Image.new("L", (right - left + 12, 48), int(rng.integers(200, 256)))
    ImageDraw.Draw(image).text((6 - left, (48 - bottom - top) // 2), line, font=font, fill=0)
    width = min(320, image.width * 48 // image.height)
    pixels = np.asarray(image.resize((width, 48)), np.float32) / 255.0
    canvas = np.zeros((48, 320), np.float32)
    canvas[:, :width] = (pixels - 0.5) / 0.5
    return np.repeat(canvas[None, None], 3, axis=1)


def _read(probabilities: np.ndarray) -> tuple[int, ...]:
    """CTC greedy decoding: best class per step, repeats merged, blanks (0) dropped."""
    best = probabilities[0].argmax(axis=-1)
    return tuple(int(c) for i, c in enumerate(best) if c != 0 and (i == 0 or c != best[i - 1]))


FONT = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf"


@pytest.mark.slow  # the recogniser is int8-sensitive: the guard's search takes minutes
@pytest.mark.skipif(not Path(FONT).exists(), reason="DejaVu fonts are not installed")
def test_int8_recogniser_reads_rendered_lines_as_fp32_does(tmp_path):
    pytest.importorskip("PIL")

    calibration = np.stack([_render(t, i) for i, t in enumerate(_text_lines(32, seed=1))])
    np.savez(tmp_path / "calib.npz", x=calibration)  # [32, 1, 3, 48, 320]: 32 samples
    source = MODELS / "ch_PP-OCRv4_rec_infer.onnx"
    shapes = {"x": (1, 3, 48, 320)}
    fp32 = kiln.Session(kiln.compile(source, tmp_path / "fp32.kiln", shapes=shapes, rounds=0).path)
    int8 = kiln.compile(source, tmp_path / "int8.kiln", shapes=shapes, precision="int8",
                        calib=str(tmp_path / "calib.npz"), calib_method="percentile",
                        rounds=0)  # fmt: skip
    assert int8.manifest.precision["calibration"]["held_out"] == 8
    session = kiln.Session(int8.path)

    held_out = _text_lines(40, seed=2)
    same = sum(
        _read(session.run(None, {"x": x})[0]) == _read(fp32.run(None, {"x": x})[0])
        for x in (_render(t, 1000 + i) for i, t in enumerate(held_out))
    )
    print(f"int8 reads {same}/{len(held_out)} held-out lines exactly as fp32 does")
    assert same >= 0.95 * len(held_out)
