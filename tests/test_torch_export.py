"""A BERT exported from PyTorch (transformers, random weights, no hub) comes out fused.

Needs torch and transformers; skipped cleanly when they are absent (`pip install
torch==2.13.0 transformers`).
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest

import kiln

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

INPUTS = ["input_ids", "attention_mask", "token_type_ids"]
LAYERS = 2  # encoder layers of the exported BERT: one fused Attention each


class _Outputs(torch.nn.Module):
    """transformers 5 models take keyword arguments; the legacy exporter passes positions."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask, token_type_ids):
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            return_dict=False,
        )
        return out[0], out[1]


def export_bert(path, attention: str | None) -> None:
    torch.manual_seed(0)
    config = transformers.BertConfig(
        hidden_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        intermediate_size=256,
        vocab_size=1000,
        attn_implementation=attention,
    )
    model = _Outputs(transformers.BertModel(config).eval())
    ids = torch.randint(0, 1000, (1, 16))
    torch.onnx.export(
        model,
        (ids, torch.ones_like(ids), torch.zeros_like(ids)),
        str(path),
        input_names=INPUTS,
        output_names=["last_hidden_state", "pooler_output"],
        dynamic_axes={name: {0: "batch", 1: "seq"} for name in INPUTS},
        opset_version=17,
        dynamo=False,
    )


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_pytorch_bert_comes_out_with_attention_fused(attention, tmp_path):
    source = tmp_path / "bert.onnx"
    export_bert(source, attention)
    artifact = kiln.compile(source, tmp_path / "bert.kiln", rounds=0)
    assert artifact.manifest.verification.ok
    assert artifact.manifest.dropped_passes == []
    graph = onnx.load(str(artifact.model_path)).graph
    counts = collections.Counter(n.op_type for n in graph.node)
    assert counts["Attention"] == LAYERS, counts
    assert counts["Softmax"] == 0, counts

    # Padding really is masked: same outputs as the export on a padded batch.
    import onnxruntime as ort

    original = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 1000, (2, 12))
    mask = np.ones((2, 12), np.int64)
    mask[1, 8:] = 0
    feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
    want = original.run(None, feeds)
    got = kiln.Session(artifact.path).run(None, feeds)
    for w, g in zip(want, got, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)
