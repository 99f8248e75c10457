"""RapidOCR's pipeline (rapidocr-onnxruntime 1.4.4, PP-OCRv4) as a Kiln pipeline function.

`read_text(image, *, det, cls, rec)` is RapidOCR's own `__call__` — its resizing, DB contour
post-processing, perspective crops, orientation classification and CTC decoding, in its own
code — with only its three ONNX Runtime sessions replaced by the models it is given, so that it
reads as `RapidOCR()(image)` does when given the wheel's models as they are — but for the
detector's normalisation and layout, written with Kiln's array ops so that they fold into the
detector (the same arithmetic in float32 where RapidOCR's runs in float64). It returns
RapidOCR's result: one `[box, text, score]` per line found (or None).

    kiln optimize benchmarks/ocr_pipeline.py:read_text --model det=... --model cls=... ...

`MODELS` names the wheel's three model files; the glue needs opencv, pyclipper and shapely.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import onnx
import rapidocr_onnxruntime
from rapidocr_onnxruntime.cal_rec_boxes import CalRecBoxes
from rapidocr_onnxruntime.ch_ppocr_cls import TextClassifier
from rapidocr_onnxruntime.ch_ppocr_cls.utils import ClsPostProcess
from rapidocr_onnxruntime.ch_ppocr_det import TextDetector
from rapidocr_onnxruntime.ch_ppocr_det.utils import DBPostProcess, DetPreProcess
from rapidocr_onnxruntime.ch_ppocr_rec import TextRecognizer
from rapidocr_onnxruntime.ch_ppocr_rec.utils import CTCLabelDecode
from rapidocr_onnxruntime.main import DEFAULT_CFG_PATH, RapidOCR
from rapidocr_onnxruntime.utils import LoadImage, read_yaml

from kiln.pipeline import ops

_ROOT = Path(rapidocr_onnxruntime.__file__).parent
CONFIG = read_yaml(DEFAULT_CFG_PATH)
MODELS = {
    "det": _ROOT / CONFIG["Det"]["model_path"],
    "cls": _ROOT / CONFIG["Cls"]["model_path"],
    "rec": _ROOT / CONFIG["Rec"]["model_path"],
}


def _characters() -> list[str]:
    """The recogniser's alphabet, kept in the wheel's model file's metadata (a compiled copy of
    the model need not keep it)."""
    meta = {
        p.key: p.value for p in onnx.load(MODELS["rec"], load_external_data=False).metadata_props
    }
    return meta["character"].splitlines()


_CHARACTERS = _characters()


class _DetPreProcess(DetPreProcess):
    """RapidOCR's detector pre-processing with its normalisation and layout written as Kiln
    array ops (the same arithmetic, in float32), which `kiln optimize` folds into the
    detector's graph: the detector then takes the resized uint8 image."""

    def __call__(self, img: Any) -> Any:
        resized = self.resize(img)
        if resized is None:
            return None
        normalized = ops.normalize(resized, self.mean, self.std, self.scale)
        return ops.to_layout(normalized, "HWC", "NCHW")


class _TextDetector(TextDetector):
    def get_preprocess(self, max_wh: int) -> _DetPreProcess:
        own = super().get_preprocess(max_wh)
        return _DetPreProcess(own.limit_side_len, own.limit_type, own.mean, own.std)


class _Infer:
    """RapidOCR's OrtInferSession call — the first input in, all outputs out — on `session`."""

    def __init__(self, session: Any) -> None:
        self.session = session
        self.input = session.get_inputs()[0].name

    def __call__(self, batch: Any) -> list[Any]:
        return self.session.run(None, {self.input: batch})


def _engine(det: Any, cls: Any, rec: Any) -> RapidOCR:
    """A RapidOCR whose three sessions are the ones given: its constructor's settings without
    opening the wheel's models (cheap: one per call, so streams share no mutable state)."""
    config, glob = CONFIG, CONFIG["Global"]
    ocr = object.__new__(RapidOCR)
    ocr.print_verbose, ocr.text_score = glob["print_verbose"], glob["text_score"]
    ocr.min_height, ocr.width_height_ratio = glob["min_height"], glob["width_height_ratio"]
    ocr.max_side_len, ocr.min_side_len = glob["max_side_len"], glob["min_side_len"]
    ocr.use_det, ocr.use_cls, ocr.use_rec = glob["use_det"], glob["use_cls"], glob["use_rec"]
    ocr.load_img, ocr.cal_rec_boxes = LoadImage(), CalRecBoxes()

    d = config["Det"]
    ocr.text_det = object.__new__(_TextDetector)
    ocr.text_det.limit_side_len, ocr.text_det.limit_type = d["limit_side_len"], d["limit_type"]
    ocr.text_det.mean, ocr.text_det.std, ocr.text_det.preprocess_op = d["mean"], d["std"], None
    ocr.text_det.postprocess_op = DBPostProcess(
        thresh=d["thresh"], box_thresh=d["box_thresh"], max_candidates=d["max_candidates"],
        unclip_ratio=d["unclip_ratio"], use_dilation=d["use_dilation"], score_mode=d["score_mode"],
    )  # fmt: skip
    ocr.text_det.infer = _Infer(det)

    c = config["Cls"]
    ocr.text_cls = object.__new__(TextClassifier)
    ocr.text_cls.cls_image_shape, ocr.text_cls.cls_batch_num = (
        c["cls_image_shape"],
        c["cls_batch_num"],
    )
    ocr.text_cls.cls_thresh = c["cls_thresh"]
    ocr.text_cls.postprocess_op = ClsPostProcess(c["label_list"])
    ocr.text_cls.infer = _Infer(cls)

    r = config["Rec"]
    ocr.text_rec = object.__new__(TextRecognizer)
    ocr.text_rec.session = _Infer(rec)
    # a copy: CTCLabelDecode inserts its blank and space into the list it is given
    ocr.text_rec.postprocess_op = CTCLabelDecode(character=list(_CHARACTERS))
    ocr.text_rec.rec_batch_num, ocr.text_rec.rec_image_shape = (
        r["rec_batch_num"],
        r["rec_img_shape"],
    )
    return ocr


def read_text(image: Any, *, det: Any, cls: Any, rec: Any) -> list | None:
    """RapidOCR's answer for `image` (a path, bytes or an array): `[box, text, score]` per line."""
    result, _elapsed = _engine(det, cls, rec)(image)
    return result


def lines(result: list | None) -> list[str]:
    """The recognised text of a result, line by line."""
    return [str(text) for _box, text, _score in result or []]


def lines_equal(references: list, outputs: list) -> float:
    """The pipeline metric: the share of recognised lines equal to the reference's, over all
    images (a line missing or extra counts as unequal)."""
    equal = total = 0
    for reference, output in zip(references, outputs, strict=True):
        want, got = lines(reference), lines(output)
        equal += sum(a == b for a, b in zip(want, got, strict=False))
        total += max(len(want), len(got))
    return equal / total if total else 1.0
