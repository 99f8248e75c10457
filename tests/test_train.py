"""kiln.train in one process: the config record, prepare() in a tutorial loop, accumulation,
fp16 loss scaling, activation checkpointing, fp32-kept modules, and fit's refusals."""

from __future__ import annotations

import json

import pytest

from kiln.errors import KilnError
from kiln.train.config import TrainConfig, read_config

torch = pytest.importorskip("torch")
nn = torch.nn


class Blocks(nn.Module):
    """A small model with repeated blocks (what checkpointing and FSDP2 look for)."""

    def __init__(self, width: int = 16, depth: int = 3, classes: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU())
            for _ in range(depth)
        )
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return Blocks()


def _data(samples: int = 64, seed: int = 1) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 16, generator=generator)
    y = torch.randint(0, 4, (samples,), generator=generator)
    return torch.utils.data.TensorDataset(x, y)


def _train(config: TrainConfig, batches: list, inject_at: int | None = None,
           skip_at: int | None = None):  # fmt: skip
    """A tutorial loop through prepare(); `inject_at` puts an inf into that step's gradients,
    `skip_at` leaves that step out by hand (no update, gradients dropped)."""
    from kiln.train import prepare

    model = _model()
    prepared = prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), config)
    stepped = []
    for index, (x, y) in enumerate(batches):
        with prepared.autocast():
            loss = nn.functional.cross_entropy(prepared.model(x).float(), y)
        if index == skip_at:
            prepared.optimizer.zero_grad()
            continue
        prepared.backward(loss)
        if index == inject_at:
            next(prepared.model.parameters()).grad.view(-1)[0] = float("inf")
        stepped.append(prepared.step())
    return prepared, stepped


def _params(prepared) -> list[torch.Tensor]:
    return [p.detach().clone() for p in prepared.model.parameters()]


def test_the_config_round_trips_through_json_and_a_file(tmp_path):
    config = TrainConfig(precision="fp16", micro_batch=8, accumulation=4, keep_fp32=("LayerNorm",))
    config = config.replace(parallel={"strategy": "ddp", "ranks": 2, "comm_hook": "bf16"},
                            checkpointing={"policy": "every", "every": 2})  # fmt: skip
    assert TrainConfig.from_json(json.loads(json.dumps(config.to_json()))) == config
    assert config.global_batch == 8 * 4 * 2
    (tmp_path / "train.json").write_text(json.dumps({"config": config.to_json()}))
    assert read_config(tmp_path / "train.json") == config


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"precision": "int8"}, "precision 'int8': use one of fp32, bf16, fp16"),
        ({"micro_batch": 0}, "micro_batch 0: use a whole number ≥ 1"),
        ({"parallel": {"strategy": "single", "ranks": 2}}, "choose ddp, fsdp2 or pipeline"),
        ({"parallel": {"stratgy": "ddp"}}, "unknown Parallel field 'stratgy'"),
        ({"loader": {"prefetch_factor": 4}}, "needs loader.workers > 0"),
        ({"checkpointing": {"policy": "selective"}}, "name the module types"),
        ({"batch": 3}, "unknown TrainConfig field 'batch'"),
    ],
)
def test_a_bad_config_names_the_field_and_what_it_takes(data, message):
    with pytest.raises(KilnError, match=message):
        TrainConfig.from_json(data)


def test_accumulating_k_micro_batches_gives_the_gradients_of_one_batch_of_k_times_b():
    data = _data(32)
    whole = [(data.tensors[0][:32], data.tensors[1][:32])]
    parts = [(data.tensors[0][i : i + 8], data.tensors[1][i : i + 8]) for i in range(0, 32, 8)]
    one, stepped_one = _train(TrainConfig(micro_batch=32), whole)
    four, stepped_four = _train(TrainConfig(micro_batch=8, accumulation=4), parts)
    assert stepped_one == [True] and stepped_four == [False, False, False, True]
    for a, b in zip(_params(one), _params(four), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_an_overflow_skips_its_step_backs_off_the_scale_and_it_grows_back():
    config = TrainConfig(precision="fp16", micro_batch=8,
                         loss_scale={"initial": 2.0**10, "interval": 2})  # fmt: skip
    data = _data(64)
    batches = [(data.tensors[0][i : i + 8], data.tensors[1][i : i + 8]) for i in range(0, 64, 8)]
    injected, stepped = _train(config, batches, inject_at=3)
    by_hand, _ = _train(config, batches, skip_at=3)
    assert stepped == [True, True, True, False, True, True, True, True]
    assert injected.skipped == 1
    events = [(e.step, e.event, e.scale) for e in injected.scale_events]
    # growth after every 2 clean steps; the overflow at step 4 halves the scale; it grows back
    assert events[:3] == [(2, "growth", 2.0**11), (4, "overflow", 2.0**10), (6, "growth", 2**11)]
    for a, b in zip(_params(injected), _params(by_hand), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_checkpointing_policies_choose_their_blocks_and_keep_the_gradients():
    from kiln.train import prepare
    from kiln.train.memory import chosen_blocks, find_blocks

    model = _model()
    assert [n for n, _ in find_blocks(model)] == ["layers.0", "layers.1", "layers.2"]
    every = TrainConfig(checkpointing={"policy": "every", "every": 2}).checkpointing
    assert [n for n, _ in chosen_blocks(model, every)] == ["layers.1"]
    selective = TrainConfig(checkpointing={"policy": "selective", "modules": ["GELU"]})
    assert len(chosen_blocks(model, selective.checkpointing)) == 3
    x, y = _data(8).tensors
    grads = []
    for policy in ("none", "full"):
        model = _model()
        prepared = prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                           TrainConfig(checkpointing={"policy": policy}))  # fmt: skip
        nn.functional.cross_entropy(prepared.model(x), y).backward()
        grads.append([p.grad.clone() for p in prepared.model.parameters()])
        assert len(prepared.checkpointed) == (3 if policy == "full" else 0)
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_a_cnn_with_pooling_between_its_conv_blocks_checkpoints_them_and_keeps_batchnorm():
    """The conv blocks between parameter-free pooling are the blocks; a checkpointed step
    gives the same gradients and batch-norm running statistics as an unwrapped one (the
    recomputation must not update them a second time)."""
    from kiln.train import prepare
    from kiln.train.memory import find_blocks

    def block(inputs: int, outputs: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(inputs, outputs, 3, padding=1), nn.BatchNorm2d(outputs),
                             nn.ReLU())  # fmt: skip

    def cnn() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Sequential(block(1, 4), block(4, 4), nn.MaxPool2d(2),
                                           block(4, 8), nn.MaxPool2d(2)),
                             nn.Flatten(), nn.Linear(8 * 4 * 4, 3))  # fmt: skip

    assert [n for n, _ in find_blocks(cnn())] == ["0.0", "0.1", "0.3"]
    x, y = torch.randn(6, 1, 16, 16), torch.tensor([0, 1, 2, 0, 1, 2])
    results = []
    for policy in ("none", "full"):
        model = cnn()
        prepared = prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                           TrainConfig(checkpointing={"policy": policy}))  # fmt: skip
        nn.functional.cross_entropy(prepared.model(x), y).backward()
        grads = [p.grad.clone() for p in prepared.model.parameters()]
        results.append((grads, prepared.model.state_dict()))
    (grads_none, state_none), (grads_full, state_full) = results
    for a, b in zip(grads_none, grads_full, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert state_none.keys() == state_full.keys()
    for key, value in state_none.items():
        torch.testing.assert_close(state_full[key], value, atol=0, rtol=0, msg=key)


def test_checkpointed_blocks_compile_and_train():
    """torch.compile over checkpointed blocks (with and without batch norm) takes a step and
    gives the eager gradients (compile refuses a recompute context that is not its own)."""
    from kiln.train import prepare

    def model() -> nn.Module:
        torch.manual_seed(0)
        blocks = (nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU()) for _ in range(2))
        return nn.Sequential(nn.Sequential(*blocks), nn.Linear(8, 3))

    x, y = torch.randn(6, 8), torch.tensor([0, 1, 2, 0, 1, 2])
    grads = []
    for compiled in (None, "default"):
        eager = model()
        config = TrainConfig(checkpointing={"policy": "full"}, compile=compiled)
        prepared = prepare(eager, torch.optim.SGD(eager.parameters(), lr=0.1), config)
        nn.functional.cross_entropy(prepared.model(x), y).backward()
        grads.append([p.grad.clone() for p in eager.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_kept_fp32_modules_run_in_fp32_under_bf16_autocast():
    from kiln.train import prepare

    model = _model()
    seen = {}
    model.head.register_forward_hook(lambda m, i, o: seen.update(head=o.dtype))
    model.layers[0][0].register_forward_hook(lambda m, i, o: seen.update(layer=o.dtype))
    prepared = prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                       TrainConfig(precision="bf16", keep_fp32=("head",)))  # fmt: skip
    with prepared.autocast():
        prepared.model(torch.randn(2, 16))
    assert seen == {"head": torch.float32, "layer": torch.bfloat16}
    with pytest.raises(KilnError, match="keep_fp32 'Nope': no module"):
        prepare(_model(), torch.optim.SGD(_model().parameters(), lr=0.1),
                TrainConfig(keep_fp32=("Nope",)))  # fmt: skip


def test_an_optimizer_of_other_parameters_is_refused():
    from kiln.train import prepare

    with pytest.raises(KilnError, match="not the model's"):
        prepare(_model(), torch.optim.SGD(_model().parameters(), lr=0.1))


def test_fit_trains_and_records_what_it_did(tmp_path):
    from kiln.train import fit

    record = fit(_model, {"train": _data(64), "val": _data(32, seed=2)},
                 config=TrainConfig(micro_batch=8, accumulation=2), steps=6,
                 checkpoint=tmp_path / "ckpt")  # fmt: skip
    assert record["steps"] == 6 and record["samples"] == 6 * 16 and len(record["loss"]) == 6
    assert record["val"]["loss"] > 0 and 0 <= record["val"]["accuracy"] <= 1
    assert record["peak_mib"]["0"] > 0 and record["samples_per_s"] > 0
    assert record["checkpoint"].endswith("step-00000006")
    resumed = fit(_model, {"train": _data(64)}, config=TrainConfig(micro_batch=8,
                  accumulation=2), steps=8, checkpoint=tmp_path / "ckpt", resume=True)  # fmt: skip
    assert resumed["steps"] == 8 and resumed["steps_this_run"] == 2


def test_a_resumed_run_reaches_the_loss_of_an_uninterrupted_one(tmp_path):
    from kiln.train import fit

    config = TrainConfig(micro_batch=8, accumulation=2, precision="fp16")  # the scaler resumes too
    whole = fit(_model, _data(64), config=config, steps=10, validate=False)
    fit(_model, _data(64), config=config, steps=4, checkpoint=tmp_path / "c", validate=False)
    rest = fit(_model, _data(64), config=config, steps=10, checkpoint=tmp_path / "c",
               resume=True, validate=False)  # fmt: skip
    assert rest["steps_this_run"] == 6
    assert rest["loss"] == pytest.approx(whole["loss"][4:], abs=1e-6)


@pytest.mark.parametrize(
    ("model", "data", "message"),
    [
        (lambda: "not a module", _data, "returned a str; expected a torch.nn.Module"),
        (_model, lambda: [1, 2, 3], "samples are ints; expected \\(input, target\\) pairs"),
        (_model, lambda: {"val": _data()}, "expected 'train'"),
    ],
)
def test_fit_names_what_is_wrong_with_the_users_functions(model, data, message):
    from kiln.train import fit

    with pytest.raises(KilnError, match=message):
        fit(model, data, config=TrainConfig(micro_batch=8), steps=1)


def test_a_loss_that_is_nan_from_the_first_step_is_one_error():
    from kiln.train import fit

    def nan_loss(out, y):
        return nn.functional.cross_entropy(out, y) * float("nan")

    with pytest.raises(KilnError, match="the loss is nan at step 1 \\(the first\\)"):
        fit(_model, _data(), loss=nan_loss, config=TrainConfig(micro_batch=8), steps=3)


def test_a_memory_budget_checkpoints_the_fewest_blocks_that_fit():
    from kiln.train.loop import budget_policy
    from kiln.train.memory import blocks_for_budget, find_blocks

    blocks = find_blocks(_model())
    # Measured probes: 90 MiB without, 30 with every block recomputed: 20 a block.
    assert blocks_for_budget(blocks, 90, 30, 100) == []
    assert [n for n, _ in blocks_for_budget(blocks, 90, 30, 75)] == ["layers.0"]
    assert len(blocks_for_budget(blocks, 90, 30, 31)) == 3
    with pytest.raises(KilnError, match="even with every block checkpointed"):
        blocks_for_budget(blocks, 90, 30, 20)
    x, y = _data(8).tensors
    config = TrainConfig(micro_batch=8, checkpointing={"policy": "budget", "budget_mib": 1e6})
    resolved = budget_policy(_model(), (x, y), nn.functional.cross_entropy, config)
    assert resolved.checkpointing.policy == "none"  # everything fits a terabyte


@pytest.mark.timeout(120)
def test_a_pipeline_fit_reports_the_last_stages_loss_and_validation():
    from kiln.train import fit

    parallel = {"strategy": "pipeline", "ranks": 2, "threads_per_rank": 1, "microbatches": 2}
    config = TrainConfig(micro_batch=8, parallel=parallel)
    record = fit(_model, _pipeline_data, config=config, steps=2)
    assert len(record["loss"]) == 2 and all(v == v for v in record["loss"])  # no NaN
    assert record["val"]["loss"] > 0 and set(record["peak_mib"]) == {"0", "1"}


def _pipeline_data() -> dict:
    return {"train": _data(32), "val": _data(16, seed=2)}
