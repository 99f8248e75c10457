"""Structured pruning removes channels, heads and FFN neurons for real, and changes nothing else.

The strong check: a pruned model computes exactly what the unpruned model computes with the
removed units' outgoing weights zeroed. Needs torch (skipped without it).
"""

from __future__ import annotations

import copy

import pytest

from kiln.errors import KilnError

torch = pytest.importorskip("torch")
nn = torch.nn

from kiln.compress.prune import prune  # noqa: E402  (needs torch)

TOL = {"atol": 1e-5, "rtol": 1e-4}


def cnn() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(16 * 4 * 4, 32), nn.ReLU(), nn.Linear(32, 10),
    )  # fmt: skip
    _randomise_norms(model)
    return model.eval()


def _randomise_norms(model: nn.Module) -> None:
    """Non-trivial BatchNorm statistics, so that cutting them wrongly would show."""
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.running_mean.uniform_(-0.5, 0.5)
            module.running_var.uniform_(0.5, 2.0)
            nn.init.uniform_(module.weight, 0.5, 1.5)


def images(batch: int = 4) -> torch.Tensor:
    return torch.rand(batch, 1, 16, 16, generator=torch.Generator().manual_seed(1))


def batches(count: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(2)
    return [(torch.rand(8, 1, 16, 16, generator=gen), torch.randint(0, 10, (8,), generator=gen))
            for _ in range(count)]  # fmt: skip


def params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def zero_columns(model: nn.Module, name: str, removed: list[int], block: int = 1) -> None:
    """Zero what reads the removed units: their input columns of the layer `name`."""
    weight = model.get_submodule(name).weight
    with torch.no_grad():
        for unit in removed:
            weight[:, unit * block : (unit + 1) * block] = 0


def removed(layer) -> list[int]:
    return sorted(set(range(layer.units_before)) - set(layer.kept))


# -- CNN channels --------------------------------------------------------------------------


def test_half_the_channels_go_and_the_model_still_runs():
    model = cnn()
    reference = model(images())
    report = prune(model, 0.5)
    convs = [m for m in model if isinstance(m, nn.Conv2d)]
    pruned = [m for m in report.model if isinstance(m, nn.Conv2d)]
    for before, after in zip(convs, pruned, strict=True):
        assert after.out_channels == before.out_channels - before.out_channels // 2
        assert after.weight.shape[0] == after.out_channels  # physically smaller, not masked
    assert report.params_after < report.params_before == params(model)
    assert report.params_after == params(report.model)
    assert report.model(images()).shape == reference.shape
    assert torch.equal(model(images()), reference)  # the model passed in is untouched
    assert {layer.kind for layer in report.layers} == {"channels", "neurons"}


def test_amount_zero_is_bit_identical():
    model = cnn()
    report = prune(model, 0.0)
    assert report.model is not model
    assert torch.equal(report.model(images()), model(images()))
    assert report.params_after == report.params_before


def test_pruned_cnn_equals_the_cnn_with_those_channels_zeroed():
    model = cnn()
    report = prune(model, 0.5, targets=("channels",))
    reference = copy.deepcopy(model)
    layers = {layer.name: layer for layer in report.layers}
    zero_columns(reference, "4", removed(layers["0"]))
    zero_columns(reference, "8", removed(layers["4"]))
    zero_columns(reference, "11", removed(layers["8"]), block=4 * 4)  # Flatten -> Linear
    torch.testing.assert_close(report.model(images()), reference(images()), **TOL)


def test_magnitude_removes_the_planted_weakest_channels():
    model = cnn()
    planted = [1, 4, 6, 7]
    with torch.no_grad():
        model[0].weight[planted] = 0
        model[0].bias[planted] = 0
    report = prune(model, 0.5, targets=("channels",))
    first = next(layer for layer in report.layers if layer.name == "0")
    assert removed(first) == planted


def test_taylor_removes_the_channels_nothing_reads():
    model = cnn()
    unread = [0, 2, 3, 5]
    with torch.no_grad():
        model[0].weight[unread] *= 10  # the largest filters: magnitude would keep them
        model[4].weight[:, unread] = 0  # ... but the next conv ignores them
    by = {
        kind: next(layer for layer in prune(model, 0.5, **kwargs).layers if layer.name == "0")
        for kind, kwargs in (
            ("taylor", {"importance": "taylor", "data": batches()}),
            ("magnitude", {}),
        )
    }
    assert removed(by["taylor"]) == unread
    assert removed(by["magnitude"]) != unread


def test_functional_cnn_with_view_flatten_and_mean():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Conv2d(3, 8, 3), nn.Conv2d(8, 12, 3)
            self.fc, self.head = nn.Linear(8 * 2 * 2, 5), nn.Linear(12, 5)

        def forward(self, x):
            x = torch.relu(self.a(x))
            y = torch.nn.functional.adaptive_avg_pool2d(x, 2)
            z = self.b(x * 0.5).mean((2, 3))
            return self.fc(y.view(y.size(0), -1)) + self.head(z)

    model = Net().eval()
    x = torch.rand(2, 3, 9, 9)
    report = prune(model, 0.5)
    assert report.model.a.out_channels == 4 and report.model.fc.in_features == 4 * 2 * 2
    reference = copy.deepcopy(model)
    layers = {layer.name: layer for layer in report.layers}
    zero_columns(reference, "b", removed(layers["a"]))
    zero_columns(reference, "fc", removed(layers["a"]), block=4)
    zero_columns(reference, "head", removed(layers["b"]))
    torch.testing.assert_close(report.model(x), reference(x), **TOL)


# -- attention heads and FFN neurons --------------------------------------------------------


NAMINGS = {  # hand-written attention blocks: q/k/v/out Linear names, head-count attribute
    "qkv": (("q_proj", "k_proj", "v_proj", "out_proj"), "num_heads"),
    "timm-style": (("q", "k", "v", "proj"), "heads"),
}


class QKVAttention(nn.Module):
    """A hand-written attention block: q/k/v/out Linears and a head count."""

    def __init__(self, dim: int, heads: int, naming: str) -> None:
        super().__init__()
        self.names, self.count = NAMINGS[naming]
        setattr(self, self.count, heads)
        self.head_dim = dim // heads
        for name in self.names:
            setattr(self, name, nn.Linear(dim, dim))

    def forward(self, x):
        b, t, _ = x.shape
        heads = getattr(self, self.count)
        q, k, v, out = (getattr(self, name) for name in self.names)
        q, k, v = (p(x).reshape(b, t, heads, self.head_dim).transpose(1, 2) for p in (q, k, v))
        attended = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return out(attended.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    """Pre-norm transformer block: attention and an FFN, each behind a residual add."""

    def __init__(self, attention: str, dim: int = 32, heads: int = 4, hidden: int = 64) -> None:
        super().__init__()
        self.attention = attention
        if attention == "mha":
            self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        else:
            self.attn = QKVAttention(dim, heads, attention)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        h = self.norm1(x)
        if self.attention == "mha":
            x = x + self.attn(h, h, h, need_weights=False)[0]
        else:
            x = x + self.attn(h)
        x = x + self.fc2(self.act(self.fc1(self.norm2(x))))
        return self.head(x.mean(1))


def tokens() -> torch.Tensor:
    return torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("attention", ["mha", *NAMINGS])
def test_pruned_heads_equal_those_heads_zeroed(attention):
    torch.manual_seed(0)
    model = Block(attention).eval()
    report = prune(model, 0.5, targets=("heads",))
    (layer,) = report.layers
    assert (layer.name, layer.kind, layer.units_after) == ("attn", "heads", 2)
    names, count = NAMINGS.get(attention, NAMINGS["qkv"])  # MHA becomes q_proj ... out_proj
    attn = report.model.attn
    assert getattr(attn, count) == 2
    q, k, v, out = (getattr(attn, name) for name in names)
    for proj in (q, k, v):
        assert proj.weight.shape == (2 * 8, 32)  # the heads' embedding rows are gone
    assert out.weight.shape == (32, 2 * 8)
    reference = copy.deepcopy(model)
    zero_columns(reference, f"attn.{names[3]}", removed(layer), block=8)
    torch.testing.assert_close(report.model(tokens()), reference(tokens()), **TOL)


def test_magnitude_removes_the_planted_weak_heads():
    torch.manual_seed(0)
    model = Block("qkv").eval()
    with torch.no_grad():
        for proj in (model.attn.q_proj, model.attn.k_proj, model.attn.v_proj):
            proj.weight[8:16] *= 0.01  # head 1
            proj.weight[24:32] *= 0.01  # head 3
    (layer,) = prune(model, 0.5, targets=("heads",)).layers
    assert removed(layer) == [1, 3]


def test_pruned_ffn_neurons_equal_those_neurons_zeroed():
    torch.manual_seed(0)
    model = Block("qkv").eval()
    report = prune(model, 0.5, targets=("neurons",))
    (layer,) = report.layers
    assert (layer.name, layer.kind) == ("fc1", "neurons")
    assert report.model.fc1.out_features == report.model.fc2.in_features == 32
    reference = copy.deepcopy(model)
    zero_columns(reference, "fc2", removed(layer))
    torch.testing.assert_close(report.model(tokens()), reference(tokens()), **TOL)


def test_torch_transformer_encoder_heads_and_ffn():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    report = prune(model, 0.5, importance="taylor", data=[(tokens(), tokens())],
                   loss_fn=torch.nn.functional.mse_loss)  # fmt: skip
    assert {(x.kind, x.units_after) for x in report.layers} == {("heads", 2), ("neurons", 32)}
    reference = copy.deepcopy(model)
    for x in report.layers:
        if x.kind == "heads":  # layers.N.self_attn
            zero_columns(reference, f"{x.name}.out_proj", removed(x), block=8)
        else:  # layers.N.linear1
            zero_columns(reference, x.name.replace("linear1", "linear2"), removed(x))
    with torch.no_grad():  # the unpruned model takes torch's fused inference path here
        torch.testing.assert_close(report.model(tokens()), reference(tokens()), **TOL)


def test_bert_heads_and_ffn_from_transformers():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                     intermediate_size=64, vocab_size=100)  # fmt: skip
    model = transformers.BertModel(config).eval()
    ids = torch.randint(0, 100, (2, 7))
    report = prune(model, 0.5)
    kinds = {x.name: x for x in report.layers}
    heads, ffn = kinds["encoder.layer.0.attention"], kinds["encoder.layer.0.intermediate.dense"]
    assert (heads.units_after, ffn.units_after) == (2, 32)
    reference = copy.deepcopy(model)
    zero_columns(reference, "encoder.layer.0.attention.output.dense", removed(heads), block=8)
    zero_columns(reference, "encoder.layer.0.output.dense", removed(ffn))
    out, expected = report.model(ids).last_hidden_state, reference(ids).last_hidden_state
    torch.testing.assert_close(out, expected, **TOL)


# -- export ---------------------------------------------------------------------------------


def initializers(path) -> dict[str, tuple[int, ...]]:
    onnx = pytest.importorskip("onnx")
    return {i.name: tuple(i.dims) for i in onnx.load(str(path)).graph.initializer}


def test_pruned_cnn_exports_smaller_weights(tmp_path):
    model = cnn()
    report = prune(model, 0.5)
    path = tmp_path / "pruned.onnx"
    torch.onnx.export(report.model, (images(1),), str(path), dynamo=True)
    shapes = initializers(path)
    assert shapes["0.weight"] == (4, 1, 3, 3)  # the conv's 8 filters are 4 in the graph
    stored = sum(torch.Size(s).numel() for s in shapes.values())
    assert stored < params(model)


def test_pruned_attention_exports(tmp_path):
    torch.manual_seed(0)
    model = Block("mha").eval()
    report = prune(model, 0.5)
    path = tmp_path / "pruned.onnx"
    torch.onnx.export(report.model, (tokens(),), str(path), dynamo=True)
    sizes = sorted(initializers(path).values())
    assert (32, 16) in sizes or (16, 32) in sizes  # q/k/v at 2 of 4 heads
    assert max(torch.Size(s).numel() for s in sizes) <= 32 * 32


# -- refusals ---------------------------------------------------------------------------------


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem, self.conv = nn.Conv2d(1, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))

    def forward(self, x):
        x = self.stem(x)
        return self.head(x + self.conv(x))


def test_residual_add_is_refused_naming_the_module():
    with pytest.raises(KilnError, match=r"'stem'.*(residual|another tensor)") as caught:
        prune(Residual(), 0.5)
    assert "\n" not in str(caught.value)


def test_grouped_conv_is_refused():
    model = nn.Sequential(nn.Conv2d(4, 8, 3), nn.ReLU(), nn.Conv2d(8, 8, 3, groups=4),
                          nn.Flatten(), nn.Linear(8 * 4 * 4, 3))  # fmt: skip
    with pytest.raises(KilnError, match=r"'0'.*grouped convolution '2'"):
        prune(model, 0.5)


def test_untraceable_caller_is_refused():
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.features = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3))
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            y = self.features(x).mean((2, 3))
            return self.fc(y) if y.sum() > 0 else -self.fc(y)

    with pytest.raises(KilnError, match=r"'features.2'.*torch.fx could not trace"):
        prune(Branchy(), 0.5)


def test_a_block_that_hard_codes_its_width_is_caught_on_the_data():
    class Fixed(QKVAttention):
        def forward(self, x):  # reshapes to the full width, whatever num_heads says
            b, t, _ = x.shape
            q = self.q_proj(x).reshape(b, t, 4, self.head_dim)
            return self.out_proj(q.reshape(b, t, 32))

    model = Block("qkv").eval()
    model.attn = Fixed(32, 4, "qkv")
    with pytest.raises(KilnError, match="pruned Block fails to run"):
        prune(model, 0.5, targets=("heads",), data=[(tokens(), torch.zeros(2, dtype=torch.long))])


def test_bad_arguments_are_one_clear_line():
    model = cnn()
    with pytest.raises(KilnError, match="taylor importance needs data"):
        prune(model, 0.5, importance="taylor")
    with pytest.raises(KilnError, match="amount"):
        prune(model, 1.0)
    with pytest.raises(KilnError, match="nothing to prune"):
        prune(nn.Sequential(nn.Linear(4, 2)), 0.5)
    wrong = [(torch.rand(2, 3, 16, 16), torch.zeros(2, dtype=torch.long))]
    with pytest.raises(KilnError, match="does not fit"):
        prune(model, 0.5, importance="taylor", data=wrong)
