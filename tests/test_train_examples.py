"""The training tasks of kiln.train.examples: the byte LM's shape and causality, the stdlib text
split and its next-byte targets, the digits dataset's pairs."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kiln.train import examples  # noqa: E402


@pytest.fixture(scope="module")
def tiny_text() -> dict:
    return examples.stdlib_text_tiny()


def test_tiny_lm_gives_logits_per_byte() -> None:
    torch.manual_seed(0)
    model = examples.byte_lm_tiny()
    x = torch.randint(0, 256, (3, 64))
    logits = model(x)
    assert logits.shape == (3, 64, 256)
    loss = examples.lm_loss(logits, x)
    assert loss.ndim == 0 and 4.0 < loss.item() < 7.0  # ≈ ln 256 = 5.5 at init
    assert len(model.layers) == 2 and all(type(b) is examples.Block for b in model.layers)


def test_init_is_deterministic_given_the_seed() -> None:
    torch.manual_seed(1)
    a = examples.byte_lm_tiny().state_dict()
    torch.manual_seed(1)
    b = examples.byte_lm_tiny().state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_lm_is_causal() -> None:
    torch.manual_seed(0)
    model = examples.byte_lm_tiny().eval()
    x = torch.randint(0, 256, (1, 32))
    changed = x.clone()
    changed[0, 20] = (x[0, 20] + 1) % 256
    with torch.no_grad():
        before, after = model(x), model(changed)
    assert torch.allclose(before[:, :20], after[:, :20], atol=1e-6)
    assert not torch.allclose(before[:, 20:], after[:, 20:])


def test_text_is_split_by_file_and_targets_are_the_next_bytes(tiny_text: dict) -> None:
    train, val = tiny_text["train"], tiny_text["val"]
    assert train.files and val.files and not set(train.files) & set(val.files)
    assert len(train) == 200_000 // 65 and len(val) == 50_000 // 65
    x, y = train[1]
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (64,)
    assert torch.equal(x[1:], y[:-1])
    assert torch.equal(train.data[65:130].long(), torch.cat([x, y[-1:]]))
    with pytest.raises(IndexError):
        train[len(train)]


def test_digits_gives_image_label_pairs() -> None:
    pytest.importorskip("sklearn")
    data = examples.digits()
    x, y = data["train"][0]
    assert x.dtype == torch.float32 and x.shape == (1, 32, 32)
    assert y.dtype == torch.int64 and 0 <= int(y) < 10
    assert len(data["val"]) > 0
    logits = examples.digits_cnn()(x.unsqueeze(0))
    assert logits.shape == (1, 10)
