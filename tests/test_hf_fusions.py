"""transformers BERT and GPT-2, exported by both PyTorch exporters with and without their
optional inputs, come out with attention, LayerNorm and GELU fused, verified, and masking
padding as the export does; a block no rule can take is named in the notes with its reason.

Needs torch and transformers (random weights, nothing downloaded); skipped without them.
"""

from __future__ import annotations

import collections
import warnings

import numpy as np
import onnx
import pytest

import kiln

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LAYERS, HIDDEN, HEADS, VOCAB = 3, 64, 4, 1000
INPUTS = {
    "bert3": ["input_ids", "attention_mask", "token_type_ids"],
    "bert2": ["input_ids", "attention_mask"],
    "gpt2": ["input_ids"],
    "gpt2-mask": ["input_ids", "attention_mask"],
}


class _Positional(torch.nn.Module):
    """transformers 5 takes keywords; exporters pass positions. Returns last_hidden_state."""

    def __init__(self, model: torch.nn.Module, names: list[str]) -> None:
        super().__init__()
        self.model, self.names = model, names

    def forward(self, input_ids, attention_mask=None, token_type_ids=None):
        given = {"attention_mask": attention_mask, "token_type_ids": token_type_ids}
        kwargs = {name: given[name] for name in self.names[1:]}
        return self.model(input_ids=input_ids, **kwargs, return_dict=False)[0]


def hf_model(variant: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if variant.startswith("bert"):
        config = transformers.BertConfig(
            hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
            intermediate_size=4 * HIDDEN, vocab_size=VOCAB,
        )  # fmt: skip
        model = transformers.BertModel(config, add_pooling_layer=False)
    else:
        config = transformers.GPT2Config(
            n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, vocab_size=VOCAB, n_positions=128
        )
        model = transformers.GPT2Model(config)
    return _Positional(model.eval(), INPUTS[variant])


def export(variant: str, exporter: str, path) -> None:
    names = INPUTS[variant]
    ids = torch.randint(0, VOCAB, (2, 16))
    example = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
               "token_type_ids": torch.zeros_like(ids)}  # fmt: skip
    args = tuple(example[n] for n in names)
    model = hf_model(variant)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "torchscript":
            torch.onnx.export(
                model, args, str(path), input_names=names, output_names=["hidden"],
                dynamic_axes={n: {0: "batch", 1: "seq"} for n in names}, opset_version=17,
                dynamo=False,
            )  # fmt: skip
        else:
            batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
            program = torch.onnx.export(
                model, args, input_names=names, output_names=["hidden"],
                dynamic_shapes=tuple({0: batch, 1: seq} for _ in names), dynamo=True,
                verbose=False,
            )  # fmt: skip
            program.save(str(path))


def op_counts(path) -> collections.Counter:
    return collections.Counter(n.op_type for n in onnx.load(str(path)).graph.node)


# The default run covers each export path once; the rest of the grid is slow.
FAST = {("bert2", "torchscript"), ("gpt2-mask", "dynamo"), ("gpt2", "torchscript")}
GRID = [
    pytest.param(v, e, marks=() if (v, e) in FAST else pytest.mark.slow)
    for v in INPUTS
    for e in ("torchscript", "dynamo")
]


@pytest.mark.parametrize(("variant", "exporter"), GRID)
def test_export_comes_out_fused_and_verified(variant, exporter, tmp_path):
    source = tmp_path / "model.onnx"
    export(variant, exporter, source)
    artifact = kiln.compile(source, tmp_path / "model.kiln", rounds=0)
    assert artifact.manifest.verification.ok
    assert artifact.manifest.dropped_passes == []
    counts = op_counts(artifact.model_path)
    # One attention, one GELU and two LayerNorms per layer; the embeddings' (BERT) or the
    # final (GPT-2) LayerNorm has no residual Add to fuse with.
    assert counts["Attention"] == LAYERS, counts
    assert counts["Softmax"] == 0, counts
    assert counts["Gelu"] + counts["FastGelu"] + counts["BiasGelu"] == LAYERS, counts
    assert counts["SkipLayerNormalization"] == 2 * LAYERS, counts
    assert counts["LayerNormalization"] == 1, counts
    assert not [n for n in artifact.manifest.notes if "stayed unfused" in n]

    # Padding really is masked: the artifact matches the export on a padded batch.
    import onnxruntime as ort

    rng = np.random.default_rng(3)
    ids = rng.integers(0, VOCAB, (2, 12))
    mask = np.ones((2, 12), np.int64)
    mask[1, 8:] = 0
    every = {"input_ids": ids, "attention_mask": mask, "token_type_ids": np.zeros_like(ids)}
    feeds = {name: every[name] for name in INPUTS[variant]}
    want = ort.InferenceSession(str(source), providers=["CPUExecutionProvider"]).run(None, feeds)
    got = kiln.Session(artifact.path).run(None, feeds)
    for w, g in zip(want, got, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


class _TemperedAttention(torch.nn.Module):
    """Self-attention whose scores are divided by a temperature given at run time: not a
    constant scale, so com.microsoft Attention cannot express it and it must stay unfused."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Linear(HIDDEN, HIDDEN)
        self.v = torch.nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x, temperature):
        batch, seq, _ = x.shape
        split = (batch, seq, HEADS, HIDDEN // HEADS)

        def heads(t):
            return t.reshape(split).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        scores = q @ k.transpose(-1, -2) / temperature
        context = torch.softmax(scores, dim=-1) @ v
        return context.transpose(1, 2).reshape(batch, seq, HIDDEN)


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = _TemperedAttention()

    def forward(self, x, temperature):
        return self.attn(x, temperature)


def test_unfusable_attention_is_named_with_the_failed_check(tmp_path):
    source = tmp_path / "tempered.onnx"
    x = torch.randn(2, 8, HIDDEN)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            _Block().eval(), (x, torch.tensor(4.0)), str(source),
            input_names=["x", "temperature"], output_names=["y"], opset_version=17,
            dynamo=False,
        )  # fmt: skip
    artifact = kiln.compile(source, tmp_path / "tempered.kiln", rounds=0)
    assert artifact.manifest.verification.ok
    assert op_counts(artifact.model_path)["Softmax"] == 1
    notes = [n for n in artifact.manifest.notes if n.startswith("attention at")]
    assert notes == [
        "attention at /attn stayed unfused: the scores are not a MatMul of Q and K (check: check)"
    ], artifact.manifest.notes
