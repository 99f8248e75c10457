"""The trained model out of `kiln train` / `kiln.train`: plain weights from a prepared (wrapped)
model, a checkpoint loaded into a plain module, `--save` and `--export`, and the road onward —
train → export → `kiln optimize` → `kiln.Session` and `kiln serve` — answering as the trained
module does."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from cli_helpers import kiln_cli  # noqa: E402

import kiln  # noqa: E402
from kiln.train import TrainConfig, fit, load, prepare  # noqa: E402

MODEL, DATA = "train_tune_helpers:wide_net", "train_tune_helpers:blobs"
TASK = ["train", MODEL, "--data", DATA, "--batch", "16", "--steps", "3"]


def probe() -> torch.Tensor:
    from train_tune_helpers import FEATURES

    return torch.randn(5, FEATURES, generator=torch.Generator().manual_seed(1))


def test_a_prepared_model_gives_the_user_module_and_its_plain_names_back():
    from train_tune_helpers import wide_net

    model = wide_net()
    config = TrainConfig(compile="default", checkpointing={"policy": "full"})
    prepared = prepare(model, torch.optim.AdamW(model.parameters()), config)
    assert all(k.startswith("_orig_mod.") for k in prepared.model.state_dict())  # compiled
    state = prepared.state_dict()
    assert list(state) == list(wide_net().state_dict())  # a plain module's names, in order
    assert prepared.unwrap() is model
    fresh = wide_net()
    fresh.load_state_dict(state)
    pairs = zip(fresh.state_dict().values(), model.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def test_fit_leaves_the_trained_weights_in_the_callers_module_and_writes_them(tmp_path):
    from train_tune_helpers import blobs, wide_net

    model = wide_net()
    saved, program = tmp_path / "model.pt", tmp_path / "model.pt2"
    record = fit(model, blobs, config=TrainConfig(micro_batch=16), steps=2, validate=False,
                 save=saved, export=program)  # fmt: skip
    assert record["written"] == {"save": str(saved), "export": str(program)}
    state = torch.load(saved, weights_only=True)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    x = probe()
    with torch.no_grad():
        expected = model.eval()(x)
        got = torch.export.load(str(program)).module()(x)  # any batch: the dim is dynamic
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


class Branchy(torch.nn.Module):
    """Trains, but does not export: a branch on a tensor's values."""

    def __init__(self) -> None:
        super().__init__()
        from train_tune_helpers import CLASSES, FEATURES

        self.head = torch.nn.Linear(FEATURES, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x) if x.sum() > 0 else -self.head(x)


def test_an_export_that_fails_after_training_says_where_the_weights_are(tmp_path):
    from train_tune_helpers import blobs

    saved, graph = tmp_path / "model.pt", tmp_path / "model.onnx"
    model = Branchy()
    with pytest.raises(kiln.KilnError) as failed:
        fit(model, blobs, config=TrainConfig(micro_batch=16), steps=1, validate=False,
            save=saved, export=graph)  # fmt: skip
    assert f"the trained weights are in {saved}" in str(failed.value)
    assert "data-dependent" in str(failed.value) and not graph.exists()
    state = torch.load(saved, weights_only=True)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())


def test_train_export_optimize_run_answers_as_the_trained_module(monkeypatch, capsys, tmp_path):
    from train_tune_helpers import wide_net

    monkeypatch.chdir(tmp_path)
    code, out, err = kiln_cli(monkeypatch, capsys, *TASK, "--checkpoint", "ckpt",
                              "--save", "model.pt", "--export", "model.onnx")  # fmt: skip
    assert code == 0, err
    assert "trained weights" in out and "model.onnx" in out  # the table says where
    trained = wide_net()
    trained.load_state_dict(torch.load("model.pt", weights_only=True))
    from_checkpoint = load("ckpt", wide_net())  # the newest whole checkpoint, step 3
    for name, value in trained.state_dict().items():
        assert torch.equal(from_checkpoint.state_dict()[name], value), name

    code, _out, err = kiln_cli(monkeypatch, capsys, "optimize", "model.onnx", "-o", "model.kiln")
    assert code == 0, err
    session = kiln.Session("model.kiln")
    x = probe()
    name = session.get_inputs()[0].name
    (got,) = session.run(None, {name: x.numpy()})
    with torch.no_grad():
        expected = trained.eval()(x).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
    np.testing.assert_array_equal(_served(session, name, x.numpy()), got)  # kiln serve's answer


def _served(session, name: str, x: np.ndarray) -> np.ndarray:
    """The artifact's answer through kiln serve's HTTP app (KServe v2 JSON)."""
    from fastapi.testclient import TestClient

    from kiln.serve.app import create_app

    body = {"inputs": [{"name": name, "datatype": "FP32", "shape": list(x.shape),
                        "data": x.ravel().tolist()}]}  # fmt: skip
    with TestClient(create_app(session, "trained")) as client:
        answer = client.post("/v2/models/trained/infer", json=body)
    assert answer.status_code == 200, answer.text
    (output,) = answer.json()["outputs"]
    return np.array(output["data"], dtype=np.float32).reshape(output["shape"])


def test_an_unwritable_export_is_refused_before_training(monkeypatch, capsys, tmp_path):
    refused = ((["--export", str(tmp_path / "model.txt")], ".onnx"),
               (["--save", str(tmp_path / "no" / "model.pt")], "does not exist"))  # fmt: skip
    for flags, named in refused:
        code, out, err = kiln_cli(monkeypatch, capsys, *TASK, *flags)
        assert code == 2 and out == "" and named in err, err
        assert len(err.strip().splitlines()) == 1


@pytest.mark.slow  # two ranks twice: ~60 s on 2 cores
@pytest.mark.parametrize("strategy", ["fsdp2", "pipeline"])
def test_weights_spread_over_ranks_are_gathered_and_exported(tmp_path, strategy):
    # FSDP2 shards every parameter, a pipeline rank holds one stage: what is written is the
    # whole model, and the export traces a plain module (no shards, no split markers).
    from train_tune_helpers import blobs, wide_net

    saved, program = tmp_path / "model.pt", tmp_path / "model.pt2"
    config = TrainConfig(micro_batch=16, parallel={"strategy": strategy, "ranks": 2})
    fit(wide_net, blobs, config=config, steps=2, validate=False, checkpoint=tmp_path / "ckpt",
        save=saved, export=program)  # fmt: skip
    trained = wide_net()
    trained.load_state_dict(torch.load(saved, weights_only=True))
    from_checkpoint = load(tmp_path / "ckpt", wide_net())
    for name, value in trained.state_dict().items():
        assert torch.equal(from_checkpoint.state_dict()[name], value), name
    x = probe()
    with torch.no_grad():
        expected = trained.eval()(x)
        got = torch.export.load(str(program)).module()(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
