"""kiln.train's distributed layer on 2 gloo ranks started by kiln.train.launch: DDP, FSDP2 and
a 1F1B pipeline train exactly as one process does on the same global batches; a failing or
killed rank ends the job as one KilnError line; checkpoints round-trip and are atomic.

The rank entry points are module-level functions (the ranks are spawned and unpickle them).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_model_state_dict,
)

from kiln.errors import KilnError  # noqa: E402
from kiln.train import checkpoint, parallel  # noqa: E402
from kiln.train.config import Parallel, TrainConfig  # noqa: E402
from kiln.train.launch import launch  # noqa: E402

RANKS = 2
STEPS = 3
BATCH = 8  # the global batch of every optimizer step
LR = 0.1
FEATURES, WIDTH, OUTPUTS, BLOCKS = 4, 8, 2, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    """An input layer, a ModuleList of like blocks (the cut points), a head: ~350 weights."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(WIDTH, OUTPUTS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(STEPS, BATCH, FEATURES, generator=generator)
    return inputs, torch.randn(STEPS, BATCH, OUTPUTS, generator=generator)


def _config(strategy: str, accumulation: int, **parallel_fields: Any) -> TrainConfig:
    replicas = 1 if strategy in ("single", "pipeline") else RANKS
    ranks = 1 if strategy == "single" else RANKS
    return TrainConfig(
        micro_batch=BATCH // (accumulation * replicas),
        accumulation=accumulation,
        parallel=Parallel(strategy=strategy, ranks=ranks, threads_per_rank=1, **parallel_fields),
    )


def _train(model: nn.Module, config: TrainConfig, rank: int) -> list[float]:
    """SGD over the global batches: this rank's share, in `accumulation` micro-steps, with
    gradient sync off on all but the last. The losses of each micro-step."""
    inputs, targets = _data()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    k, b = config.accumulation, config.micro_batch
    losses = []
    for step in range(STEPS):
        for micro in range(k):
            rows = slice(rank * k * b + micro * b, rank * k * b + (micro + 1) * b)
            last = micro == k - 1
            with contextlib.nullcontext() if last else parallel.no_sync(model):
                loss = nn.functional.mse_loss(model(inputs[step, rows]), targets[step, rows])
                (loss / k).backward()
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return losses


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    # Gathers FSDP2's shards and drops DDP's "module." prefix: comparable to one process's.
    options = StateDictOptions(full_state_dict=True)
    return {k: v.detach().clone() for k, v in get_model_state_dict(model, options=options).items()}


def _reference() -> dict[str, torch.Tensor]:
    model = _net()
    _train(model, _config("single", 1), rank=0)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=0, msg=name)


def _unsynced_under_no_sync(model: nn.Module) -> bool:
    """A backward under no_sync on different data per rank leaves the gradients unreduced:
    DDP's differ between ranks; FSDP2 keeps them unsharded and reduces nothing into .grad."""
    rank = torch.distributed.get_rank()
    with parallel.no_sync(model):
        model(torch.full((2, FEATURES), float(rank + 1))).sum().backward()
    grads = [p.grad for p in model.parameters()]
    model.zero_grad()
    if isinstance(model, nn.parallel.DistributedDataParallel):
        local = torch.cat([g.flatten() for g in grads])
        gathered = [torch.empty_like(local) for _ in range(RANKS)]
        torch.distributed.all_gather(gathered, local)
        return not torch.equal(gathered[0], gathered[1])
    return all(g is None for g in grads)


# ---------------------------------------------------------------------------- rank entries


def _data_parallel_entry(strategy: str, directory: str) -> dict[str, Any]:
    """Plain steps, then 2 accumulation micro-steps under no_sync; for fsdp2 also a sharded
    checkpoint saved by both ranks and loaded into a fresh wrapped model."""
    results: dict[str, Any] = {}
    for name, k in (("plain", 1), ("accumulated", 2)):
        config = _config(strategy, k)
        dist = parallel.setup(config)
        model = parallel.wrap(_net(), config, dist)
        _train(model, config, dist.rank)
        results[name] = _full_state(model)
    results["unsynced"] = _unsynced_under_no_sync(model)
    if strategy == "fsdp2":
        results["restored"] = _checkpoint_round_trip(model, config, dist, directory)
    parallel.teardown()
    return results


def _checkpoint_round_trip(
    model: nn.Module, config: TrainConfig, dist: parallel.Dist, directory: str
) -> bool:
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    saved = checkpoint.save(directory, 7, model, optimizer, {"note": "fsdp2"})
    fresh = parallel.wrap(Net(), config, dist)  # other weights until loaded
    step, extra = checkpoint.load(saved, fresh, torch.optim.SGD(fresh.parameters(), lr=LR))
    want, got = _full_state(model), _full_state(fresh)
    same = want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    return step == 7 and extra == {"note": "fsdp2"} and same


def _pipeline_entry(schedule: str) -> dict[str, Any]:
    """Each rank trains its stage; returns its parameters and (last stage) the losses."""
    results: dict[str, Any] = {}
    inputs, targets = _data()
    for name, k in (("plain", 1), ("accumulated", 2)):
        config = _config("pipeline", k, schedule=schedule, microbatches=2)
        dist = parallel.setup(config)
        b = config.micro_batch
        runner = parallel.pipeline(_net(), config, dist, nn.functional.mse_loss, (inputs[0, :b],))
        optimizer = torch.optim.SGD(runner.module.parameters(), lr=LR)
        losses = []
        for step in range(STEPS):
            for micro in range(k):
                rows = slice(micro * b, (micro + 1) * b)
                loss = runner.step(inputs[step, rows], targets[step, rows], loss_scale=1 / k)
                losses.append(None if loss is None else loss.item())
            optimizer.step()
            optimizer.zero_grad()
        results[name] = {n: p.detach().clone() for n, p in runner.module.named_parameters()}
        results[f"{name}_losses"] = losses
    parallel.teardown()
    return results


def _failing_entry(how: str) -> None:
    """A DDP step in which rank 1 raises (or is killed) between forward and backward, while
    rank 0 waits for it in the gradient all-reduce."""
    config = _config("ddp", 1)
    dist = parallel.setup(config)
    model = parallel.wrap(_net(), config, dist)
    inputs, targets = _data()
    loss = nn.functional.mse_loss(model(inputs[0, :4]), targets[0, :4])
    if dist.rank == 1 and how == "raise":
        raise ValueError("planted failure in rank 1")
    if dist.rank == 1 and how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    loss.backward()
    parallel.teardown()


# ---------------------------------------------------------------------------------- tests


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_data_parallel_matches_one_process(strategy: str, tmp_path: Path) -> None:
    results = launch(_data_parallel_entry, (strategy, str(tmp_path)), RANKS)
    reference = _reference()
    for rank in range(RANKS):
        _assert_same(results[rank]["plain"], reference)
        _assert_same(results[rank]["accumulated"], reference)
    assert results[1]["unsynced"], "no_sync left gradient synchronisation on"
    if strategy == "fsdp2":
        assert results[0]["restored"] and results[1]["restored"]
        assert checkpoint.latest(tmp_path) == tmp_path / "step-00000007"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("schedule", ["1f1b", "interleaved1f1b"])
def test_pipeline_matches_one_process(schedule: str) -> None:
    results = launch(_pipeline_entry, (schedule,), RANKS)
    reference = _reference()
    for name in ("plain", "accumulated"):
        stages = {_unstaged(n): p for rank in range(RANKS) for n, p in results[rank][name].items()}
        assert sum(len(results[rank][name]) for rank in range(RANKS)) == len(stages)  # no overlap
        _assert_same(stages, reference)
    assert results[0]["plain_losses"] == [None] * STEPS  # the loss lives on the last stage
    assert results[1]["plain_losses"] == pytest.approx(_reference_losses(), abs=1e-6)


def _unstaged(name: str) -> str:
    """The model's own name of an interleaved rank's parameter ("stage2.head.weight")."""
    return name.split(".", 1)[1] if name.startswith("stage") else name


def _reference_losses() -> list[float]:
    return _train(_net(), _config("single", 1), rank=0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("how", "said"), [("raise", "ValueError: planted failure in rank 1"),
                                           ("kill", "SIGKILL")])  # fmt: skip
def test_a_failing_rank_ends_the_job_as_one_line(how: str, said: str) -> None:
    started = time.monotonic()
    with pytest.raises(KilnError) as failure:
        launch(_failing_entry, (how,), RANKS)
    message = str(failure.value)
    assert time.monotonic() - started < 60
    assert "\n" not in message and len(message) < 400
    assert message.startswith("rank 1 ") and said in message
    if how == "raise":
        assert f"{Path(__file__).name}:" in message  # where it was raised


def test_setup_says_how_to_start_the_ranks_it_lacks() -> None:
    with pytest.raises(KilnError, match="kiln train --nproc 2"):
        parallel.setup(_config("ddp", 1))  # this process is a world of 1


def test_a_lambda_entry_is_refused_before_any_rank_starts() -> None:
    with pytest.raises(KilnError, match="module level"):
        launch(lambda: None, (), RANKS)


def test_rendezvous_port_in_use_is_one_line() -> None:
    import socket

    with socket.socket() as holder:
        holder.bind(("localhost", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(KilnError, match=f"localhost:{port}: the port is already in use"):
            launch(_failing_entry, ("none",), RANKS, rdzv_endpoint=f"localhost:{port}")


# ------------------------------------------------------------------------ checkpoints


def _trained() -> tuple[Net, torch.optim.Optimizer]:
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)  # has per-parameter state
    inputs, targets = _data()
    for step in range(2):
        nn.functional.mse_loss(model(inputs[step]), targets[step]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def test_checkpoint_round_trip_in_one_process(tmp_path: Path) -> None:
    model, optimizer = _trained()
    extra = {"epoch": 3, "rng": torch.arange(4)}
    path = checkpoint.save(tmp_path, 2, model, optimizer, extra)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    moments = {k: v.clone() for k, v in optimizer.state[model.head.weight].items()}

    fresh = Net()  # other weights, and an optimizer with no state yet
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.01)
    step, got = checkpoint.load(tmp_path, fresh, fresh_optimizer)

    assert (step, path) == (2, tmp_path / "step-00000002")
    assert got["epoch"] == 3 and torch.equal(got["rng"], extra["rng"])
    _assert_same(fresh.state_dict(), weights)
    _assert_same(fresh_optimizer.state[fresh.head.weight], moments)


def test_latest_ignores_partial_checkpoints_and_keeps_two(tmp_path: Path) -> None:
    model, optimizer = _trained()
    for step in (1, 2, 3):
        checkpoint.save(tmp_path, step, model, optimizer, {})
    (tmp_path / ".step-00000009.partial").mkdir()  # a save that crashed
    (tmp_path / "step-00000010").mkdir()  # no record: never completed
    assert checkpoint.latest(tmp_path) == tmp_path / "step-00000003"
    kept = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))
    assert kept == ["step-00000002", "step-00000003", "step-00000010"]


def test_a_damaged_checkpoint_is_named(tmp_path: Path) -> None:
    model, optimizer = _trained()
    path = checkpoint.save(tmp_path, 5, model, optimizer, {})
    (path / ".metadata").unlink()
    with pytest.raises(KilnError, match="step-00000005"):
        fresh = _net()
        checkpoint.load(path, fresh, torch.optim.AdamW(fresh.parameters()))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(KilnError, match="no complete checkpoint"):
        checkpoint.load(empty, _net(), None)


# ------------------------------------------------------------------------ fit of an instance


def _samples() -> torch.utils.data.TensorDataset:
    inputs, targets = _data()
    return torch.utils.data.TensorDataset(inputs.reshape(-1, FEATURES),
                                          targets.reshape(-1, OUTPUTS))  # fmt: skip


@pytest.mark.timeout(240)
def test_fit_of_a_module_instance_on_two_ranks_trains_as_a_factory_does(tmp_path: Path) -> None:
    """Each rank trains its own replica of the caller's module (not storage shared between
    them), step for step as when each builds it; the caller's module ends trained."""
    from kiln.train import fit

    run = {"loss": nn.functional.mse_loss, "config": _config("ddp", 1), "steps": STEPS,
           "validate": False}  # fmt: skip
    made = fit(_net, _samples(), save=tmp_path / "factory.pt", **run)
    model = _net()
    given = fit(model, _samples(), **run)
    assert given["loss"] == made["loss"]
    _assert_same(model.state_dict(), torch.load(tmp_path / "factory.pt"))


# ------------------------------------------------------------------------ under torchrun


def _script_entry() -> dict[str, Any]:
    """A user's script, the same whatever torchrun's --nproc-per-node: a TrainConfig that
    names no ranks, the loader prepare() gives, SGD."""
    from kiln.train import prepare

    model = _net()
    config = TrainConfig(micro_batch=BATCH // RANKS, loader={"shuffle": False},
                         parallel={"threads_per_rank": 1})  # fmt: skip
    prepared = prepare(model, torch.optim.SGD(model.parameters(), lr=LR), config)
    for inputs, targets in prepared.loader(_samples()):
        prepared.train_step(inputs, targets, nn.functional.mse_loss)
    state = _full_state(prepared.model)
    parallel.teardown()
    return {"parallel": prepared.config.parallel, "state": state}


@pytest.mark.timeout(120)
def test_prepare_takes_the_world_size_torchrun_set(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in (("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"), ("RANK", "0")):
        monkeypatch.setenv(name, value)  # torchrun --nproc-per-node 1
    alone = _script_entry()
    assert (alone["parallel"].strategy, alone["parallel"].ranks) == ("single", 1)
    results = launch(_script_entry, (), RANKS)  # torchrun --nproc-per-node 2
    for rank in range(RANKS):
        assert (results[rank]["parallel"].strategy, results[rank]["parallel"].ranks) == (
            "ddp", RANKS)  # fmt: skip
        # Each rank took half of every batch of 8 and DDP averaged: one process's steps.
        _assert_same(results[rank]["state"], _reference())
