"""What a training run reports and decides as it goes: the learning rate warms up and then
follows its schedule, a resumed run goes on at the same rate (and refuses another schedule),
clipping bounds the gradient norm and `grad_norm` reports it, early stopping ends the run
after PATIENCE validations without a lower loss and keeps the best step's checkpoint,
metrics lines appear while the run is going (TensorBoard's too, where installed), and ranks
reduce and gather a metric."""

from __future__ import annotations

import json
import math
import shutil

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

from kiln.errors import KilnError  # noqa: E402
from kiln.train import TrainConfig, fit, load, prepare  # noqa: E402
from kiln.train.launch import launch  # noqa: E402
from kiln.train.parallel import teardown  # noqa: E402

LR = 0.1
JSONL = "metrics.jsonl"  # the file a --metrics directory holds
SAMPLES = 16


def linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 1)


def regression() -> dict[str, torch.utils.data.TensorDataset]:
    """A least-squares problem; validation is on the training samples, so gradient descent
    on the whole set lowers the validation loss at every step."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 4, generator=generator)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1
    data = torch.utils.data.TensorDataset(x, y)
    return {"train": data, "val": data}


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR)


def learn_for_4_steps(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """A user's own scheduler: the optimizer's rate for 4 steps, then none (nothing learnt)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda done: 1.0 if done < 4 else 0.0)


def _train(config: TrainConfig, steps: int, **options) -> dict:
    return fit(linear, regression, loss=nn.functional.mse_loss, optimizer=sgd, config=config,
               steps=steps, validate=False, **options)  # fmt: skip


def _lines(directory) -> list[dict]:
    return [json.loads(line) for line in (directory / JSONL).read_text().splitlines()]


def test_the_rate_warms_up_then_follows_a_cosine_and_each_step_is_logged_as_it_ends(tmp_path):
    warmup, steps = 3, 10
    seen: list[int] = []  # lines in the file when each step is reported

    def count(state: dict) -> None:
        seen.append(len((tmp_path / JSONL).read_text().splitlines()))

    config = TrainConfig(micro_batch=4, lr_schedule="cosine", warmup=warmup)
    record = _train(config, steps, metrics=tmp_path, progress=count)
    lines = _lines(tmp_path)
    assert seen == list(range(1, steps + 1))  # written as the run goes, one per step
    assert [line["step"] for line in lines] == list(range(1, steps + 1))
    assert [line["loss"] for line in lines] == record["loss"]
    # Step i of the warm-up takes i/warmup of the rate; the cosine then decays from the full
    # rate over the remaining steps.
    want = [LR * i / warmup for i in range(1, warmup + 1)]
    want += [LR * 0.5 * (1 + math.cos(math.pi * k / (steps - warmup)))
             for k in range(steps - warmup)]  # fmt: skip
    assert [line["lr"] for line in lines] == pytest.approx(want)
    for line in lines:
        assert line["grad_norm"] > 0 and line["samples_per_s"] > 0


def test_clipping_bounds_the_step_and_grad_norm_reports_the_norm_before_it():
    for clip in (None, 0.5):
        model = linear()
        prepared = prepare(model, sgd, TrainConfig(clip_grad_norm=clip))
        x, y = regression()["train"].tensors
        loss = nn.functional.mse_loss(model(x), y)
        grads = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
        norm = float(torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads])))
        before = [p.detach().clone() for p in model.parameters()]
        prepared.backward(loss)
        prepared.step()
        # Plain SGD moves the parameters by lr × the (clipped) gradient.
        after = model.parameters()
        moved = torch.cat([(b - a.detach()).flatten() for b, a in zip(before, after, strict=True)])
        assert norm > 0.5 and prepared.grad_norm == pytest.approx(norm)
        expected = norm if clip is None else clip
        assert float(torch.linalg.vector_norm(moved)) == pytest.approx(LR * expected, rel=1e-4)


def test_early_stop_ends_after_patience_validations_and_keeps_the_best_step(tmp_path):
    config = TrainConfig(micro_batch=SAMPLES, lr_schedule="test_train_schedule:learn_for_4_steps")
    record = _train(config, 20, checkpoint=tmp_path / "run", val_every=2, early_stop=2,
                    metrics=tmp_path / "metrics")  # fmt: skip
    # Validations at 2 and 4 are lower each time; from step 5 nothing is learnt, so 6 and 8
    # are no lower: the second of them stops the run.
    losses = [v["loss"] for v in record["validations"]]
    assert [v["step"] for v in record["validations"]] == [2, 4, 6, 8]
    assert losses[1] < losses[0] and losses[2:] == [losses[1]] * 2
    assert record["stopped_early"] and record["steps"] == 8
    best = record["best"]
    assert best["step"] == 4 and best["loss"] == min(losses)
    assert sorted(p.name for p in (tmp_path / "run" / "best").iterdir()) == ["step-00000004"]
    # The checkpoint kept is the model of that loss.
    x, y = regression()["val"].tensors
    model = load(best["checkpoint"], linear())
    with torch.no_grad():
        assert float(nn.functional.mse_loss(model(x), y)) == pytest.approx(best["loss"])
    marks = [line.get("best") for line in _lines(tmp_path / "metrics") if "val_loss" in line]
    assert marks == [True, True, False, False]


def test_a_resumed_run_goes_on_at_the_rate_of_the_uninterrupted_one(tmp_path):
    config = TrainConfig(micro_batch=4, lr_schedule="linear", warmup=4)
    whole = _train(config, 12, checkpoint=tmp_path / "a", checkpoint_every=6,
                   metrics=tmp_path / "a-metrics")  # fmt: skip
    shutil.copytree(tmp_path / "a" / "step-00000006", tmp_path / "b" / "step-00000006")
    rest = _train(config, 12, checkpoint=tmp_path / "b", resume=True,
                  metrics=tmp_path / "b-metrics")  # fmt: skip
    rates = [line["lr"] for line in _lines(tmp_path / "a-metrics")]
    assert [line["lr"] for line in _lines(tmp_path / "b-metrics")] == rates[6:]
    assert rest["loss"] == whole["loss"][6:]
    with pytest.raises(KilnError, match="lr_schedule linear → cosine; warmup 4 → 0"):
        _train(config.replace(lr_schedule="cosine", warmup=0), 14, checkpoint=tmp_path / "b",
               resume=True)  # fmt: skip


def _reduce_and_gather() -> dict:
    config = TrainConfig(parallel={"strategy": "ddp", "ranks": 2, "threads_per_rank": 1})
    prepared = prepare(linear(), sgd, config)
    rank = prepared.dist.rank
    found = {
        "mean": prepared.reduce(float(rank + 1)),
        "sum": prepared.reduce(torch.tensor([rank, 10 * rank]), op="sum").tolist(),
        "max": prepared.reduce(float(rank), op="max"),
        "tensors": [t.tolist() for t in prepared.gather(torch.tensor([rank, -rank]))],
        "objects": prepared.gather({"rank": rank}),
    }
    teardown()
    return found


def test_tensorboard_gets_the_same_scalars_where_it_is_installed(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = TrainConfig(micro_batch=4, lr_schedule="cosine", warmup=2)
    _train(config, 4, metrics=tmp_path, val_every=2)
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    lines = _lines(tmp_path)
    rates = [(e.step, e.value) for e in events.Scalars("train/lr")]
    assert rates == [(line["step"], pytest.approx(line["lr"])) for line in lines if "lr" in line]
    assert [e.step for e in events.Scalars("val/loss")] == [2, 4]


@pytest.mark.timeout(180)
def test_two_ranks_reduce_and_gather_a_metric():
    results = launch(_reduce_and_gather, (), 2)
    for rank in (0, 1):
        assert results[rank] == {"mean": 1.5, "sum": [1, 10], "max": 1.0,
                                 "tensors": [[0, 0], [1, -1]],
                                 "objects": [{"rank": 0}, {"rank": 1}]}  # fmt: skip
