"""prepare() remakes the user's optimizer where the config or the strategy needs it (fused or
foreach kernels; FSDP2's sharded parameters; a pipeline stage's share) and it still trains as
the user's own optimizer would: torch's AdamW, a subclass of the user's, its state and the LR
scheduler bound to it included. Each run is compared with the plain loop, unwrapped."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_model_state_dict,
)

from kiln.train import parallel, prepare  # noqa: E402
from kiln.train.config import TrainConfig  # noqa: E402
from kiln.train.launch import launch  # noqa: E402
from kiln.train.prepared import _plain  # noqa: E402

STEPS, BATCH, WIDTH, BLOCKS = 3, 8, 8, 2


class Net(nn.Module):
    """Like blocks (FSDP2's units, a pipeline's cut points) and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            *(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(BLOCKS))
        )
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def _model() -> nn.Module:
    torch.manual_seed(0)
    return Net()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, WIDTH, generator=generator),
             torch.randn(BATCH, 2, generator=generator)) for _ in range(STEPS)]  # fmt: skip


class Damped(torch.optim.SGD):
    """A user's optimizer: its constructor takes less than SGD's `defaults` hold, and a
    setting (`damping`) that is an attribute, not a hyperparameter."""

    def __init__(self, params: Any, lr: float = 0.1, damping: float = 1.0) -> None:
        super().__init__(params, lr=lr, momentum=0.9)
        self.damping = damping

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    param.grad.mul_(self.damping)
        return super().step(closure)


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def _damped(params: Any) -> torch.optim.Optimizer:
    return Damped(params, lr=0.05, damping=0.5)


def _reference(make: Callable[[Any], torch.optim.Optimizer]) -> dict[str, torch.Tensor]:
    """The plain loop: one step before any scheduler (the optimizer has state), then a
    StepLR halving the rate after each step."""
    model = _model()
    optimizer = make(model.parameters())
    scheduler = _warm_up(model, optimizer)
    for x, y in _batches():
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _warm_up(model: nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    x, y = _batches()[0]
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)


def _prepared(make: Callable[[Any], torch.optim.Optimizer], config: TrainConfig,
              **extra: Any) -> dict[str, torch.Tensor]:  # fmt: skip
    """The same through prepare(): the optimizer made, stepped and bound to its scheduler
    before prepare() sees it; this rank's weights afterwards, by their plain names."""
    model = _model()
    optimizer = make(model.parameters())
    scheduler = _warm_up(model, optimizer)
    prepared = prepare(model, optimizer, config, **extra)
    assert prepared.optimizer is optimizer  # what the caller and the scheduler hold
    for x, y in _batches():
        # A pipeline's schedule feeds the first stage and scores the last: every rank takes
        # the whole batch.
        prepared.train_step(x, y, nn.functional.mse_loss)
        scheduler.step()
    if prepared.config.parallel.strategy == "fsdp2":
        state = get_model_state_dict(prepared.model, options=StateDictOptions(
            full_state_dict=True))  # fmt: skip
    else:
        state = prepared.model.state_dict()
    return {_plain(k): v.detach().clone() for k, v in state.items()}


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("implementation", ["fused", "foreach"])
@pytest.mark.parametrize("make", [_adamw, _damped], ids=["adamw", "subclass"])
def test_a_fused_or_foreach_config_remakes_the_optimizer_and_it_trains_the_same(
    implementation: str, make: Callable[[Any], torch.optim.Optimizer]
) -> None:
    config = TrainConfig(micro_batch=BATCH, **{implementation: True})
    got = _prepared(make, config)
    _assert_same(got, _reference(make))


def test_a_fused_config_reaches_the_optimizers_kernels() -> None:
    model = _model()
    optimizer = _adamw(model.parameters())
    prepare(model, optimizer, TrainConfig(micro_batch=BATCH, fused=True))
    assert all(group["fused"] for group in optimizer.param_groups)
    assert optimizer._step_supports_amp_scaling  # what the constructor sets for fused


def test_an_optimizer_factory_with_a_fused_config_is_remade_too() -> None:
    model = _model()
    prepared = prepare(model, _adamw, TrainConfig(micro_batch=BATCH, fused=True))
    assert all(group["fused"] for group in prepared.optimizer.param_groups)
    assert prepared.optimizer.param_groups[0]["weight_decay"] == 0.1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("make", [_adamw, _damped], ids=["adamw", "subclass"])
def test_one_rank_fsdp2_remakes_the_optimizer_over_the_shards(
    make: Callable[[Any], torch.optim.Optimizer],
) -> None:
    config = TrainConfig(micro_batch=BATCH, parallel={"strategy": "fsdp2",
                                                      "threads_per_rank": 1})  # fmt: skip
    try:
        got = _prepared(make, config)
    finally:
        parallel.teardown()
    _assert_same(got, _reference(make))


def _two_rank_entry(strategy: str) -> dict[str, torch.Tensor]:
    fields: dict[str, Any] = {"strategy": strategy, "ranks": 2, "threads_per_rank": 1}
    if strategy == "fsdp2":
        config = TrainConfig(micro_batch=BATCH // 2, parallel=fields)
        return _prepared_share(config, int(os.environ["RANK"]))
    config = TrainConfig(micro_batch=BATCH, parallel={**fields, "microbatches": 2})
    example = _batches()[0][0]
    return _prepared(_adamw, config, loss_fn=nn.functional.mse_loss, example=example)


def _prepared_share(config: TrainConfig, rank: int) -> dict[str, torch.Tensor]:
    """FSDP2 ranks each take half of every global batch."""
    model = _model()
    optimizer = _adamw(model.parameters())
    scheduler = _warm_up(model, optimizer)
    prepared = prepare(model, optimizer, config)
    assert prepared.optimizer is optimizer
    rows = slice(rank * config.micro_batch, (rank + 1) * config.micro_batch)
    for x, y in _batches():
        prepared.train_step(x[rows], y[rows], nn.functional.mse_loss)
        scheduler.step()
    state = get_model_state_dict(prepared.model, options=StateDictOptions(full_state_dict=True))
    return {_plain(k): v.detach().clone() for k, v in state.items()}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy", ["fsdp2", "pipeline"])
def test_an_adamw_instance_on_two_ranks_trains_as_the_unwrapped_run(strategy: str) -> None:
    results = launch(_two_rank_entry, (strategy,), 2)
    want = _reference(_adamw)
    if strategy == "fsdp2":
        for rank in (0, 1):
            _assert_same(results[rank], want)
    else:  # each rank holds its stage: together they are the whole model, once
        stages = {**results[0], **results[1]}
        assert len(results[0]) + len(results[1]) == len(stages)
        _assert_same(stages, want)
