"""`prepare(model, optimizer, config) -> Prepared`: a TrainConfig applied to a user's own loop.

A tutorial loop changes in four lines: the model and loader come from `prepared`, the forward
runs in `prepared.autocast()`, `loss.backward()` becomes `prepared.backward(loss)` and
`optimizer.step(); optimizer.zero_grad()` becomes `prepared.step()`:

    prepared = prepare(model, optimizer, config)
    for x, y in prepared.loader(dataset):
        with prepared.autocast():
            loss = loss_fn(prepared.model(x), y)
        prepared.backward(loss)
        prepared.step()          # steps once every `accumulation` calls; False while it waits

What each does: `backward` divides the loss by the accumulation steps, multiplies it by the
loss scale (fp16) and turns gradient synchronisation off for every micro-step but the last
(DDP's `require_backward_grad_sync`, FSDP2's `set_requires_gradient_sync`); `step` unscales,
clips, steps unless the gradients overflowed, updates the scale and zeroes the gradients. A
pipeline runs forward and backward together: `prepared.train_step(x, y, loss_fn)` works for
every strategy and is what `kiln.train.fit` uses.

The optimizer may be an instance or a function of the parameters. Where the parameters change
(FSDP2 shards them into DTensors; a pipeline rank holds only its stage), or the config chooses
its implementation (foreach, fused), an instance is remade by its own constructor (the
arguments it takes, from its hyperparameters) over the new parameters, with its parameter
groups (matched by parameter name) and state, as torchtitan builds optimizers after sharding;
the object stays the caller's, so an LR scheduler made on it still drives it.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from kiln.errors import KilnError
from kiln.train import memory, parallel, precision, schedule
from kiln.train.config import TrainConfig
from kiln.train.phases import phase

OptimizerArg = torch.optim.Optimizer | Callable[[Any], torch.optim.Optimizer]
Loss = Callable[[Any, Any], torch.Tensor]


@dataclass
class ScaleEvent:
    """A change of the fp16 loss scale: at which optimizer step, to what, and why."""

    step: int
    scale: float
    event: str  # "overflow" (step skipped, scale backed off) or "growth"


@dataclass
class Prepared:
    """A model, optimizer and config ready for a training loop (see the module docstring)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    config: TrainConfig
    dist: parallel.Dist
    scaler: Any
    checkpointed: list[str] = field(default_factory=list)  # blocks recomputed in backward
    kept_fp32: list[str] = field(default_factory=list)
    pipeline: Any = None  # parallel.PipelineRunner where the strategy is pipeline
    steps: int = 0  # optimizer steps taken
    skipped: int = 0  # optimizer steps skipped on overflow
    scale_events: list[ScaleEvent] = field(default_factory=list)
    scheduler: Any = None  # the LR scheduler step() steps (kiln.train.schedule), or None
    schedule_steps: int | None = None  # the run length a decaying schedule spreads over
    lr: float | None = None  # the learning rate the last optimizer step took (first group's)
    _grad_norm: torch.Tensor | None = None  # of the last step's gradients, before clipping
    _micro: int = 0  # backward calls since the last optimizer step
    _wrapped: nn.Module | None = None  # the DDP/FSDP2 module under torch.compile
    _user: nn.Module | None = None  # the module as the user gave it (unwrap)

    # ---------------------------------------------------------------- the loop's four calls

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward's precision context (bf16/fp16 autocast; nothing for fp32)."""
        return precision.autocast(self.config, self.dist.device)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss: divided by the accumulation steps, scaled
        (fp16), gradients synchronised across ranks only on the last micro-step."""
        if self.pipeline is not None:
            raise KilnError(
                "parallel.strategy pipeline runs forward and backward together: call "
                "prepared.train_step(inputs, targets, loss_fn) instead of backward()."
            )
        self._micro += 1
        self.scaler.scale(loss / self.config.accumulation).backward()
        # The *next* forward decides DDP's sync (its reducer is armed in forward).
        self._sync(self._micro + 1 >= self.config.accumulation)

    def step(self) -> bool:
        """The optimizer step, once every `accumulation` backward calls: unscale, clip (the
        gradient norm is kept: `grad_norm`), skip on overflow, update the scale, step the LR
        scheduler, zero the gradients. Whether it stepped."""
        if self._micro < self.config.accumulation:
            return False
        if self.scheduler is None and schedule.needs_length(self.config):
            raise KilnError(f"lr_schedule {self.config.lr_schedule} decays over the run's "
                            "steps: pass prepare(..., steps=N), or call prepared.schedule(N) "
                            "before the first step.")  # fmt: skip
        self._micro = 0
        # The scaler's step unscales anyway; doing it first makes the norm the true one.
        self.scaler.unscale_(self.optimizer)
        self._grad_norm = self._norm()
        before = self.loss_scale
        self.lr = float(self.optimizer.param_groups[0]["lr"])
        self.scaler.step(self.optimizer)
        self.scaler.update()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=self.config.set_to_none)
        self._sync(self.config.accumulation == 1)
        return self._account(before)

    def train_step(self, inputs: Any, targets: Any, loss_fn: Loss) -> torch.Tensor | None:
        """One micro-batch through every strategy, pipeline included: forward (under
        autocast), backward, and the optimizer step when the accumulation is complete. The
        loss (None on pipeline ranks other than the last)."""
        if self.pipeline is not None:
            # The schedule runs forward and backward together: the loss is scaled inside it
            # (fp16's scale, divided by the accumulation steps, as backward() does).
            scale = float(self.scaler.get_scale()) if self.scaler.is_enabled() else 1.0
            with phase("forward"), self.autocast():
                loss = self.pipeline.step(inputs, targets,
                                          loss_scale=scale / self.config.accumulation)  # fmt: skip
            self._micro += 1
        else:
            with phase("forward"), self.autocast():
                loss = loss_fn(self.model(inputs), targets)
            with phase("backward"):
                self.backward(loss)
        with phase("optimizer"):
            self.step()
        return loss

    @property
    def grad_norm(self) -> float | None:
        """The global norm of the last optimizer step's gradients (unscaled, before
        clipping), over every rank's parameters for ddp and fsdp2 (a pipeline rank's: its
        stage's); None before the first step. Reading it waits for the GPU."""
        return None if self._grad_norm is None else float(self._grad_norm)

    def schedule(self, steps: int | None) -> None:
        """Build the LR scheduler of `config.lr_schedule` and `warmup` for a run of `steps`
        optimizer steps (a decaying schedule needs them; `prepare(..., steps=N)` does this)."""
        self.scheduler = schedule.scheduler(self.optimizer, self.config, steps)
        self.schedule_steps = steps if schedule.needs_length(self.config) else None

    def reduce(self, value: float | torch.Tensor, op: str = "mean") -> Any:
        """A metric combined over the ranks (sum, mean, max or min), on every rank: a
        number as a float, a tensor as a tensor. Every rank must call it."""
        return parallel.reduce(value, op, self.dist)

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value` in rank order, on every rank (tensors of one shape as
        tensors, anything else that pickles as objects). Every rank must call it."""
        return parallel.gather(value, self.dist)

    @property
    def loss_scale(self) -> float | None:
        """The fp16 loss scale now (None where there is none: fp32, bf16)."""
        return float(self.scaler.get_scale()) if self.scaler.is_enabled() else None

    def loader(self, dataset: Any, **overrides: Any) -> Any:
        """A DataLoader of `dataset` with the config's micro-batch and loader settings, and
        under data-parallel ranks a DistributedSampler that gives each rank its share (and a
        new shuffle each epoch). `overrides` go to the DataLoader (e.g. collate_fn)."""
        from kiln.train.loader import make_loader

        return make_loader(dataset, self.config, self.dist, **overrides)

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps besides the weights: steps, the loss scaler and the LR
        scheduler."""
        scheduler = self.scheduler.state_dict() if self.scheduler is not None else {}
        return {"steps": self.steps, "skipped": self.skipped, "scheduler": scheduler,
                "scaler": self.scaler.state_dict() if self.scaler.is_enabled() else {}}  # fmt: skip

    def unwrap(self) -> nn.Module:
        """The user's own module, holding the trained weights, without torch.compile's and
        DDP's wrappers (a pipeline's stages gathered into it: there every rank must call
        it). FSDP2 shards the module in place: take `state_dict()` there."""
        if self.config.parallel.strategy == "fsdp2":
            raise KilnError(
                "unwrap: under fsdp2 the module's parameters are shards; take "
                "prepared.state_dict() on every rank and load it into a module you build."
            )
        assert self._user is not None
        if self.pipeline is not None:
            from kiln.train.export import remove_split_points

            self._user.load_state_dict(self.state_dict())
            remove_split_points(self._user)
        return self._user

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's weights, on the CPU, under the names of the user's own module
        (no `_orig_mod.` or `module.` prefixes): what `model.load_state_dict` of a plain
        module takes. FSDP2's shards and a pipeline's stages are gathered: under those
        every rank must call it."""
        from kiln.train.export import gathered_state_dict

        return gathered_state_dict(self)

    def load_state(self, state: dict[str, Any]) -> None:
        self.steps, self.skipped = int(state.get("steps", 0)), int(state.get("skipped", 0))
        if self.scaler.is_enabled() and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        if self.scheduler is not None and state.get("scheduler"):
            schedule.restore(self.scheduler, state["scheduler"], self.optimizer)

    # ---------------------------------------------------------------- inside

    def _sync(self, enabled: bool) -> None:
        module = self._wrapped
        if module is None:
            return
        if hasattr(module, "require_backward_grad_sync"):  # DDP
            module.require_backward_grad_sync = enabled
        elif hasattr(module, "set_requires_gradient_sync"):  # FSDP2
            module.set_requires_gradient_sync(enabled)

    def _norm(self) -> torch.Tensor:
        """The gradients' global norm, clipped to `clip_grad_norm` where set (clipping
        computes it: no second pass). A tensor: no wait for the GPU here."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if self.config.clip_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(params, self.config.clip_grad_norm)
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        # FSDP2: the shards' norms combined here, on every rank (reading it is then local).
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def _account(self, before: float | None) -> bool:
        after = self.loss_scale
        self.steps += 1
        if before is not None and after is not None and after < before:
            self.skipped += 1
            self.scale_events.append(ScaleEvent(self.steps, after, "overflow"))
            return False
        if before is not None and after is not None and after > before:
            self.scale_events.append(ScaleEvent(self.steps, after, "growth"))
        return True


def prepare(
    model: nn.Module,
    optimizer: OptimizerArg,
    config: TrainConfig | None = None,
    *,
    loss_fn: Loss | None = None,
    example: Any = None,
    steps: int | None = None,
) -> Prepared:
    """`model` and `optimizer` made ready for `config` (default TrainConfig()): joined to the
    ranks torchrun started (a config that names no ranks takes torchrun's world, and without
    a strategy trains ddp: see parallel.launched), fp32 modules pinned, blocks checkpointed,
    wrapped for DDP/FSDP2 or split into this rank's pipeline stage, compiled. A pipeline
    needs `loss_fn` and an `example` micro-batch input (the stages are traced on it).
    `steps`: the optimizer steps the run will take, which a decaying `lr_schedule` spreads
    its decay over."""
    config = parallel.launched(config or TrainConfig())
    _check_model(model)
    dist = parallel.setup(config)
    torch.manual_seed(config.seed)
    model = user = model.to(dist.device)
    kept = precision.keep_in_fp32(model, config.keep_fp32, dist.device)
    blocks = memory.chosen_blocks(model, config.checkpointing)
    if config.checkpointing.policy == "budget":
        raise KilnError(
            "checkpointing.policy budget is decided from measured probes of real steps: use "
            "kiln.train.fit (kiln train), or kiln.train.loop.budget_policy(model, batch, "
            "loss_fn, config) to resolve it first."
        )
    memory.apply_checkpointing(model, blocks, compiled=config.compile is not None)
    if blocks:  # the memory recompute saves must leave the process (see kiln.train.memory)
        memory.give_back_large_frees()
    names = {id(p): n for n, p in model.named_parameters()}
    groups = _groups(optimizer, names)
    runner, wrapped = None, None
    strategy = config.parallel.strategy
    if strategy == "pipeline":
        if loss_fn is None or example is None:
            raise KilnError(
                "parallel.strategy pipeline splits the model by tracing it: pass "
                "prepare(..., loss_fn=..., example=one micro-batch of inputs)."
            )
        runner = parallel.pipeline(model, config, dist, loss_fn, example)
        model = runner.module
    elif strategy in ("ddp", "fsdp2"):
        model = wrapped = parallel.wrap(model, config, dist)
    if config.compile is not None:
        model = torch.compile(model, mode=config.compile)
    optimizer = _optimizer(optimizer, groups, model, config, rebuild=strategy in (
        "fsdp2", "pipeline"))  # fmt: skip
    scaler = precision.grad_scaler(config, dist.device, sharded=strategy == "fsdp2")
    prepared = Prepared(model, optimizer, config, dist, scaler, [n for n, _ in blocks], kept,
                        runner, _wrapped=wrapped, _user=user)  # fmt: skip
    prepared._sync(config.accumulation == 1)
    if steps is not None or not schedule.needs_length(config):
        prepared.schedule(steps)  # else fit (or the user) gives the length once it is known
    return prepared


def _check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise KilnError(f"prepare: the model is a {type(model).__name__}; expected an nn.Module.")
    if not any(p.requires_grad for p in model.parameters()):
        raise KilnError("prepare: the model has no trainable parameters (requires_grad).")


def _groups(optimizer: OptimizerArg, names: dict[int, str]) -> list[dict[str, Any]] | None:
    """The optimizer's parameter groups with parameters as names (to rebuild it after the
    parameters change); None for an optimizer factory."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        if not callable(optimizer):
            raise KilnError(
                f"prepare: the optimizer is a {type(optimizer).__name__}; expected a "
                "torch.optim.Optimizer or a function of the parameters that returns one."
            )
        return None
    groups = []
    for group in optimizer.param_groups:
        unknown = [p for p in group["params"] if id(p) not in names]
        if unknown:
            raise KilnError(
                "prepare: the optimizer holds parameters that are not the model's; build it "
                "from model.parameters()."
            )
        groups.append({**group, "params": [names[id(p)] for p in group["params"]]})
    return groups


def _optimizer(
    optimizer: OptimizerArg,
    groups: list[dict[str, Any]] | None,
    model: nn.Module,
    config: TrainConfig,
    rebuild: bool,
) -> torch.optim.Optimizer:
    """The optimizer over the parameters the model now has, with the config's foreach/fused."""
    impl = _implementation(config)
    if groups is None:  # a factory: called on the parameters as they are now
        made = optimizer(list(model.parameters()))
        if not isinstance(made, torch.optim.Optimizer):
            raise KilnError(
                f"prepare: the optimizer function returned a {type(made).__name__}; expected "
                "a torch.optim.Optimizer."
            )
        if not impl:
            return made
        names = {id(p): n for n, p in model.named_parameters()}
        optimizer, groups = made, _groups(made, names)
    assert isinstance(optimizer, torch.optim.Optimizer) and groups is not None
    if not rebuild and not impl:
        return optimizer
    return _rebuild(optimizer, groups, model, impl)


def _implementation(config: TrainConfig) -> dict[str, bool | None]:
    """The config's foreach/fused as constructor arguments. One chosen rules out the other
    the optimizer may hold (torch refuses both True)."""
    impl = {k: v for k, v in (("foreach", config.foreach), ("fused", config.fused))
            if v is not None}  # fmt: skip
    if impl.get("fused"):
        impl.setdefault("foreach", None)
    if impl.get("foreach"):
        impl.setdefault("fused", None)
    return impl


def _rebuild(
    optimizer: torch.optim.Optimizer,
    groups: list[dict[str, Any]],
    model: nn.Module,
    impl: dict[str, bool | None],
) -> torch.optim.Optimizer:
    """`optimizer` remade by its own constructor over the parameters the model has now
    (FSDP2's shards, a pipeline stage's share), with its groups' hyperparameters and its
    state, and with the config's implementation. The caller's object is kept and takes the
    new one's attributes: an LR scheduler bound to it goes on driving it."""
    now = {_plain(n): p for n, p in model.named_parameters()}
    rebuilt, state = [], {}
    for group, held in zip(groups, optimizer.param_groups, strict=True):
        params = []
        for name, old in zip(group["params"], held["params"], strict=True):
            param = now.get(_plain(name))
            if param is None:  # a pipeline stage holds only some of the parameters
                continue
            params.append(param)
            if old in optimizer.state:
                state[param] = _placed(optimizer.state[old], param)
        if params:
            rebuilt.append({**group, **impl, "params": params})
    fresh = type(optimizer)(rebuilt, **_arguments(optimizer, impl))
    if state:
        # Loaded rather than assigned: each value moves to its parameter's device (the GPU
        # prepare moved the model to) by torch's own policy, `step` included where fused.
        order = {id(p): i for i, p in enumerate(p for g in fresh.param_groups for p in g["params"])}
        saved = fresh.state_dict()
        saved["state"] = {order[id(param)]: value for param, value in state.items()}
        fresh.load_state_dict(saved)
    # Hooks registered on the caller's optimizer stay, as does the step wrapper an LR
    # scheduler put on the instance (the fresh one has none of its own).
    vars(optimizer).update({k: v for k, v in vars(fresh).items() if not k.endswith("_hooks")})
    return optimizer


def _arguments(optimizer: torch.optim.Optimizer, impl: dict[str, bool | None]) -> dict[str, Any]:
    """What the optimizer's constructor takes besides the parameters, each from the config's
    implementation, the optimizer's hyperparameters (`defaults`), or an attribute of the same
    name (where constructors keep settings that are not per-group)."""
    kind = type(optimizer).__name__
    accepted = _accepted(type(optimizer))
    arguments: dict[str, Any] = {}
    for name, value in impl.items():
        if name in accepted:
            arguments[name] = value
        elif name not in optimizer.defaults and value is not None:
            # Else torch's step reads it from each group, where _rebuild puts it.
            raise KilnError(f"{name}: {kind} has no {name} implementation; leave {name} unset "
                            "in the config for this optimizer.")  # fmt: skip
    for name, parameter in accepted.items():
        if name in arguments:
            continue
        if name in optimizer.defaults:
            arguments[name] = optimizer.defaults[name]
        elif name in vars(optimizer):
            arguments[name] = vars(optimizer)[name]
        elif parameter.default is inspect.Parameter.empty:
            raise KilnError(
                f"prepare: cannot remake {kind} over the model's new parameters: its "
                f"constructor's argument {name} is neither in its defaults nor an attribute; "
                f"pass a function of the parameters instead, e.g. lambda params: {kind}(params, "
                f"{name}=...)."
            )
    return arguments


def _accepted(kind: type) -> dict[str, inspect.Parameter]:
    """The keyword arguments `kind`'s constructor takes after the parameters; where it passes
    **kwargs on to its base class, the base's too (AdamW's own omit Adam's
    decoupled_weight_decay, which its `defaults` hold)."""
    accepted: dict[str, inspect.Parameter] = {}
    for klass in kind.__mro__:
        if klass is torch.optim.Optimizer:
            break
        init = vars(klass).get("__init__")
        if init is None:
            continue
        parameters = list(inspect.signature(init).parameters.values())[2:]  # self, params
        named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        for parameter in parameters:
            if parameter.kind in named:
                accepted.setdefault(parameter.name, parameter)
        if all(p.kind is not inspect.Parameter.VAR_KEYWORD for p in parameters):
            break
    return accepted


def _placed(state: dict[str, Any], param: torch.Tensor) -> dict[str, Any]:
    """A parameter's optimizer state for its new parameter: where FSDP2 sharded the parameter
    into a DTensor, each full-size state tensor (Adam's moments, momentum) is sharded alike."""
    if not isinstance(param, DTensor):
        return dict(state)
    return {
        key: distribute_tensor(value.to(param.device), param.device_mesh, param.placements)
        if isinstance(value, torch.Tensor)
        and not isinstance(value, DTensor)
        and value.shape == param.shape
        else value
        for key, value in state.items()
    }


def _plain(name: str) -> str:
    """A parameter's name without the wrappers' prefixes (torch.compile, checkpointing)."""
    for prefix in ("_orig_mod.", "_checkpoint_wrapped_module.", "module."):
        name = name.replace(prefix, "")
    return name


def batches(loader: Any) -> Iterator[Any]:
    """The loader's batches, epoch after epoch, without end (fit counts steps itself)."""
    while True:
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise KilnError(
                "the dataset gave no batch: it holds fewer samples than one micro_batch "
                "(with drop_last); lower micro_batch or give more data."
            )
