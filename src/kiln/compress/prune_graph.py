"""Which units of a model can be removed, and which weights each one touches.

Channels and FFN neurons are found on the model's torch.fx graph, not by module order: from
a Conv or Linear the graph is followed through ops that keep units apart (activations,
dropout, pooling, BatchNorm, flatten) to the layers that read them. Heads are found by module
type: nn.MultiheadAttention, a block with q_proj/k_proj/v_proj/out_proj Linears and
`num_heads`, and Hugging Face BERT-style attention. Channels that cannot be removed safely
(a residual add, a grouped conv, an op Kiln cannot follow) refuse with a KilnError naming the
module; a conv that produces a model output is left whole and listed as skipped.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from kiln.compress.pruned_attention import HeadPrunedAttention
from kiln.compress.surgery import Group, Slice
from kiln.errors import KilnError

CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
ELEMENTWISE_MODULES = (
    nn.ReLU,
    nn.ReLU6,
    nn.LeakyReLU,
    nn.GELU,
    nn.SiLU,
    nn.Sigmoid,
    nn.Tanh,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.Hardtanh,
    nn.ELU,
    nn.SELU,
    nn.CELU,
    nn.Mish,
    nn.Softplus,
    nn.Identity,
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
)
ELEMENTWISE_FUNCTIONS = {
    F.relu, F.relu6, F.gelu, F.silu, F.leaky_relu, F.elu, F.selu, F.celu, F.hardswish,
    F.hardsigmoid, F.hardtanh, F.mish, F.softplus, F.dropout, F.dropout1d, F.dropout2d,
    F.dropout3d, F.sigmoid, F.tanh, torch.relu, torch.sigmoid, torch.tanh, torch.abs,
    torch.clamp, torch.mul, torch.add, torch.sub, torch.div, operator.mul, operator.add,
    operator.sub, operator.truediv, operator.neg,
}  # fmt: skip
ELEMENTWISE_METHODS = {
    "relu", "sigmoid", "tanh", "abs", "clamp", "contiguous", "clone", "mul", "add", "sub", "div",
}  # fmt: skip
POOL_MODULES = (
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.MaxPool3d,
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AvgPool3d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d,
)
POOL_FUNCTIONS = {
    F.max_pool1d, F.max_pool2d, F.max_pool3d, F.avg_pool1d, F.avg_pool2d, F.avg_pool3d,
    F.adaptive_avg_pool1d, F.adaptive_avg_pool2d, F.adaptive_avg_pool3d,
    F.adaptive_max_pool1d, F.adaptive_max_pool2d, F.adaptive_max_pool3d,
}  # fmt: skip

# Hand-written attention: separate q/k/v/out Linears and an int head count, by these names.
QKV_NAMES = (
    ("q_proj", "k_proj", "v_proj", "out_proj"),
    ("q_proj", "k_proj", "v_proj", "o_proj"),
    ("q", "k", "v", "proj"),
    ("query", "key", "value", "out"),
)
HEAD_COUNTS = ("num_heads", "heads", "n_heads", "num_attention_heads")

SPATIAL, FLAT = "spatial", "flat"  # a conv's channels on axis 1, or flattened into blocks


@dataclass
class Found:
    """The groups to prune, the units left whole (name, why), and how many layers qualified."""

    groups: list[Group] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    candidates: int = 0


def find_groups(model: nn.Module, targets: set[str], amount: float) -> Found:
    """Prunable layers of `model` (edited only to swap in HeadPrunedAttention where heads go)."""
    found = Found()
    if "heads" in targets:
        _attention_groups(model, amount, found)
    if "neurons" in targets:
        _recipe_neuron_groups(model, found)
    if targets & {"channels", "neurons"}:
        _GraphSearch(model, targets, found).run()
    return found


def removed_units(units: int, amount: float) -> int:
    """How many of `units` go at `amount`: never more than asked, and one always stays."""
    return min(units - 1, math.floor(units * amount + 1e-9))


# -- heads ---------------------------------------------------------------------------------


def is_attention_block(module: nn.Module) -> bool:
    """A block whose heads Kiln knows how to remove (fx treats it as one opaque call)."""
    return _is_qkv_block(module) or _is_bert_attention(module)


def _is_qkv_block(module: nn.Module) -> bool:
    return _qkv_names(module) is not None


def _qkv_names(module: nn.Module) -> tuple[tuple[str, ...], str] | None:
    """The q/k/v/out Linear names and the head-count attribute of a hand-written block."""
    count = next((a for a in HEAD_COUNTS if isinstance(getattr(module, a, None), int)), None)
    if count is None:
        return None
    for names in QKV_NAMES:
        if all(isinstance(getattr(module, n, None), nn.Linear) for n in names):
            return names, count
    return None


def _is_bert_attention(module: nn.Module) -> bool:
    inner, output = getattr(module, "self", None), getattr(module, "output", None)
    names = ("query", "key", "value")
    return (
        isinstance(inner, nn.Module)
        and all(isinstance(getattr(inner, n, None), nn.Linear) for n in names)
        and isinstance(getattr(inner, "num_attention_heads", None), int)
        and isinstance(getattr(output, "dense", None), nn.Linear)
    )


def _attention_groups(model: nn.Module, amount: float, found: Found) -> None:
    replaced = False
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.MultiheadAttention):
            _check_mha(name, module)
            found.candidates += 1
            if removed_units(module.num_heads, amount) == 0:
                continue  # left as it is: an untouched model stays bit-identical
            if not name:
                raise KilnError(
                    "cannot prune the heads of a bare nn.MultiheadAttention: it is replaced "
                    "by a narrower module, so pass the model that holds it."
                )
            module = HeadPrunedAttention(module)
            model.set_submodule(name, module)
            replaced = True
            found.groups.append(_qkv_group(name, module))
        elif _is_qkv_block(module):
            found.candidates += 1
            found.groups.append(_qkv_group(name, module))
        elif _is_bert_attention(module):
            found.candidates += 1
            found.groups.append(_bert_group(name, module))
    if replaced:  # its nested-tensor fast path reads the packed full-width attention weights
        for module in model.modules():
            if isinstance(module, nn.TransformerEncoder):
                module.use_nested_tensor = False


def _check_mha(name: str, module: nn.MultiheadAttention) -> None:
    if module.bias_k is not None or module.add_zero_attn:
        raise KilnError(
            f"cannot prune the heads of '{name}': an nn.MultiheadAttention with add_bias_kv or "
            "add_zero_attn shares its extra key/value rows across heads; leave 'heads' out of "
            "targets."
        )


def _qkv_group(name: str, module: nn.Module) -> Group:
    names, count = _qkv_names(module)
    heads = getattr(module, count)
    q, k, v, out = (getattr(module, n) for n in names)
    width = q.out_features
    head_dim = width // heads if width % heads == 0 else 0
    widths = {k.out_features, v.out_features, out.in_features}
    if head_dim == 0 or widths != {width} or getattr(module, "head_dim", head_dim) != head_dim:
        raise KilnError(
            f"cannot prune the heads of '{name}': q/k/v/out widths "
            f"({width}, {k.out_features}, {v.out_features}, {out.in_features}) are not "
            f"{count}={heads} equal heads; leave 'heads' out of targets."
        )

    def finish(keep: torch.Tensor) -> None:
        setattr(module, count, len(keep))
        if isinstance(module, HeadPrunedAttention):
            module.kept_heads = module.kept_heads[keep.to(module.kept_heads.device)]

    producers = [Slice(p, 0, head_dim) for p in (q, k, v)]
    return Group(name, "heads", heads, module, producers, [Slice(out, 1, head_dim)], [], finish)


def _bert_group(name: str, module: nn.Module) -> Group:
    inner = module.self
    heads, head_dim = inner.num_attention_heads, inner.attention_head_size

    def finish(keep: torch.Tensor) -> None:
        inner.num_attention_heads = len(keep)
        inner.all_head_size = len(keep) * head_dim

    producers = [Slice(getattr(inner, n), 0, head_dim) for n in ("query", "key", "value")]
    consumers = [Slice(module.output.dense, 1, head_dim)]
    return Group(name, "heads", heads, module, producers, consumers, [], finish)


# -- neurons in blocks fx cannot see into ------------------------------------------------


def _recipe_neuron_groups(model: nn.Module, found: Found) -> None:
    """FFNs inside torch's Transformer layers (opaque to fx) and BERT-style layers."""
    for name, module in model.named_modules():
        pair = _ffn_pair(module)
        if pair is None:
            continue
        first, second = pair
        found.candidates += 1
        found.groups.append(
            Group(
                f"{name}.{first[0]}",
                "neurons",
                first[1].out_features,
                first[1],
                [Slice(first[1], 0)],
                [Slice(second, 1)],
            )
        )


def _ffn_pair(module: nn.Module) -> tuple[tuple[str, nn.Linear], nn.Linear] | None:
    if isinstance(module, nn.TransformerEncoderLayer | nn.TransformerDecoderLayer):
        return ("linear1", module.linear1), module.linear2
    first = getattr(getattr(module, "intermediate", None), "dense", None)
    second = getattr(getattr(module, "output", None), "dense", None)
    linears = isinstance(first, nn.Linear) and isinstance(second, nn.Linear)
    if linears and first.out_features == second.in_features:
        return ("intermediate.dense", first), second
    return None


# -- channels and neurons on the fx graph --------------------------------------------------


class _Tracer(fx.Tracer):
    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return is_attention_block(m) or super().is_leaf_module(m, qualname)


@dataclass
class _Trace:
    prefix: str  # qualified name of the traced module ("" for the model itself)
    module: nn.Module
    graph: fx.Graph
    caller_failure: str | None  # why the caller could not be traced; None for the model

    def name(self, target: str) -> str:
        return f"{self.prefix}.{target}" if self.prefix else target


@dataclass
class _Reach:
    """Where a layer's units go: BatchNorms riding along, the layers reading them, or a stop."""

    followers: list[nn.Module] = field(default_factory=list)
    consumers: list[Slice] = field(default_factory=list)
    stop: str | None = None
    at_output: bool = False


class _GraphSearch:
    def __init__(self, model: nn.Module, targets: set[str], found: Found) -> None:
        self.model, self.targets, self.found = model, targets, found
        self.traces: list[_Trace] = []
        self.untraced: dict[str, str] = {}  # module name -> why its code could not be traced
        self.calls: Counter[str] = Counter()
        self.grouped = {id(g.owner) for g in found.groups}

    def run(self) -> None:
        self._trace("", self.model, None)
        for trace in self.traces:
            for node in trace.graph.nodes:
                if node.op == "call_module":
                    self.calls[trace.name(node.target)] += 1
        for trace in self.traces:
            for node in trace.graph.nodes:
                if node.op == "call_module":
                    self._visit(trace, node)
        if "channels" in self.targets:
            self._refuse_unseen_convs()

    def _trace(self, prefix: str, module: nn.Module, failure: str | None) -> None:
        try:
            graph = _Tracer().trace(module)
        except Exception as error:  # fx raises many kinds for Python it cannot trace
            reason = _first_line(error)
            for child_name, child in module.named_children():
                child_prefix = f"{prefix}.{child_name}" if prefix else child_name
                if _Tracer().is_leaf_module(child, child_prefix):
                    self.untraced[child_prefix] = reason
                else:
                    self._trace(child_prefix, child, reason)
            return
        self.traces.append(_Trace(prefix, module, graph, failure))

    def _visit(self, trace: _Trace, node: fx.Node) -> None:
        module = trace.module.get_submodule(node.target)
        name = trace.name(node.target)
        if type(module) in CONVS and "channels" in self.targets:
            self._conv(trace, node, name, module)
        elif type(module) is nn.Linear and "neurons" in self.targets:
            self._linear(trace, node, name, module)

    def _conv(self, trace: _Trace, node: fx.Node, name: str, conv: nn.Module) -> None:
        if conv.groups != 1:
            _refuse(
                name,
                f"it is a grouped convolution (groups={conv.groups}), whose output "
                "channels are tied to its input channels",
            )
        if self.calls[name] > 1:
            _refuse(name, "the module is called more than once, so its channels are shared")
        reach = self._follow(trace, node, conv.out_channels, SPATIAL)
        if reach.at_output and reach.stop is None:
            self.found.skipped.append((name, "its output channels are a model output"))
            return
        if reach.stop is not None:
            _refuse(name, reach.stop)
        self.found.candidates += 1
        self.found.groups.append(
            Group(
                name,
                "channels",
                conv.out_channels,
                conv,
                [Slice(conv, 0)],
                reach.consumers,
                reach.followers,
            )
        )

    def _linear(self, trace: _Trace, node: fx.Node, name: str, linear: nn.Linear) -> None:
        if id(linear) in self.grouped or self.calls[name] > 1:
            return
        reach = self._follow(trace, node, linear.out_features, "features")
        if reach.stop is None and not reach.at_output and not reach.followers:
            self.found.candidates += 1  # Linear -> activation -> Linear: an FFN
            self.found.groups.append(
                Group(
                    name,
                    "neurons",
                    linear.out_features,
                    linear,
                    [Slice(linear, 0)],
                    reach.consumers,
                )
            )

    def _follow(self, trace: _Trace, start: fx.Node, units: int, state: str) -> _Reach:
        reach = _Reach()
        pending, seen = [(start, state)], set()
        while pending and reach.stop is None:
            value, value_state = pending.pop()
            for user in value.users:
                if (user, value_state) in seen:
                    continue
                seen.add((user, value_state))
                step = self._step(trace, user, value, value_state, units, reach)
                if step is not None:
                    pending.append((user, step))
        return reach

    def _step(self, trace, user, value, state, units, reach) -> str | None:
        """Records what `user` does with `value`; returns the state to follow it in, or None."""
        if _is_shape_query(user):
            return None  # reads the shape, not the values: nothing to cut there
        if user.op == "output":
            if trace.caller_failure is None:
                reach.at_output = True
            else:
                reach.stop = (
                    f"its output leaves '{trace.prefix}', whose caller torch.fx "
                    f"could not trace ({trace.caller_failure})"
                )
            return None
        if _other_inputs(user, value) and not _is_view_flatten(user):
            reach.stop = (
                f"it meets another tensor at {_describe(trace, user)} (a residual add "
                "or concat ties its channels to that tensor's)"
            )
            return None
        if user.op == "call_module":
            return self._module_step(trace, user, state, units, reach)
        return self._op_step(trace, user, state, reach)

    def _module_step(self, trace, user, state, units, reach) -> str | None:
        module = trace.module.get_submodule(user.target)
        name = trace.name(user.target)
        if isinstance(module, ELEMENTWISE_MODULES):
            return state
        if self.calls[name] > 1 and not isinstance(module, ELEMENTWISE_MODULES + POOL_MODULES):
            reach.stop = f"it feeds '{name}', which is called more than once"
        elif state == SPATIAL and isinstance(module, POOL_MODULES):
            return state
        elif state == SPATIAL and isinstance(module, NORMS):
            reach.followers.append(module)
            return state
        elif state == SPATIAL and isinstance(module, nn.Flatten):
            if module.start_dim == 1 and module.end_dim == -1:
                return FLAT
            reach.stop = f"it is flattened by '{name}' from dim {module.start_dim}, not 1"
        elif state == SPATIAL and type(module) in CONVS:
            if module.groups == 1:
                reach.consumers.append(Slice(module, 1))
            else:
                reach.stop = (
                    f"it feeds the grouped convolution '{name}' "
                    f"(groups={module.groups}), whose input channels are tied"
                )
        elif state != SPATIAL and type(module) is nn.Linear:
            block = module.in_features // units
            if block * units == module.in_features:
                reach.consumers.append(Slice(module, 1, block))
            else:
                reach.stop = (
                    f"'{name}' reads {module.in_features} features, not a multiple "
                    f"of its {units} units"
                )
        else:
            reach.stop = f"it reaches {_describe(trace, user)}, which Kiln cannot prune through"
        return None

    def _op_step(self, trace, user, state, reach) -> str | None:
        target = user.target
        if user.op == "call_function" and target in ELEMENTWISE_FUNCTIONS:
            return state
        if user.op == "call_method" and target in ELEMENTWISE_METHODS:
            return state
        if state == SPATIAL and user.op == "call_function" and target in POOL_FUNCTIONS:
            return state
        if state == SPATIAL and _flattens_from_dim1(user):
            return FLAT
        if state == SPATIAL and _is_spatial_mean(user):
            keepdim = user.kwargs.get("keepdim", len(user.args) > 2 and user.args[2])
            return SPATIAL if keepdim else FLAT
        reach.stop = f"it reaches {_describe(trace, user)}, which Kiln cannot prune through"
        return None

    def _refuse_unseen_convs(self) -> None:
        """A conv called from code fx could not trace cannot be followed: refuse it."""
        for name, module in self.model.named_modules():
            if type(module) in CONVS and name in self.untraced:
                why = self.untraced[name]
                _refuse(name, f"torch.fx could not trace the code that calls it ({why})")


def _other_inputs(user: fx.Node, value: fx.Node) -> bool:
    return any(n is not value for n in user.all_input_nodes)


def _is_shape_query(user: fx.Node) -> bool:
    if user.op == "call_method":
        return user.target in ("size", "dim")
    return user.op == "call_function" and user.target is getattr and user.args[1] == "shape"


def _is_view_flatten(user: fx.Node) -> bool:
    """x.view(x.size(0), -1) / x.reshape(batch, -1): a flatten from dim 1."""
    args = user.args
    return (
        user.op == "call_method"
        and user.target in ("view", "reshape")
        and len(args) == 3
        and args[2] == -1
    )


def _flattens_from_dim1(user: fx.Node) -> bool:
    if _is_view_flatten(user):
        return True
    is_flatten = (user.op == "call_function" and user.target is torch.flatten) or (
        user.op == "call_method" and user.target == "flatten"
    )
    if not is_flatten:
        return False
    start = user.args[1] if len(user.args) > 1 else user.kwargs.get("start_dim", 0)
    end = user.args[2] if len(user.args) > 2 else user.kwargs.get("end_dim", -1)
    return start == 1 and end == -1


def _is_spatial_mean(user: fx.Node) -> bool:
    """x.mean((2, 3)) and torch.mean(x, dim=(2, 3)): a global average pool over space."""
    is_mean = (user.op == "call_method" and user.target == "mean") or (
        user.op == "call_function" and user.target is torch.mean
    )
    if not is_mean:
        return False
    dims = user.args[1] if len(user.args) > 1 else user.kwargs.get("dim")
    dims = (dims,) if isinstance(dims, int) else dims
    return bool(dims) and all(isinstance(d, int) and d >= 2 for d in dims)


def _describe(trace: _Trace, node: fx.Node) -> str:
    if node.op == "call_module":
        module = trace.module.get_submodule(node.target)
        return f"{type(module).__name__} '{trace.name(node.target)}'"
    if node.op == "call_method":
        return f".{node.target}() (fx node '{node.name}')"
    label = getattr(node.target, "__name__", str(node.target))
    return f"{label} (fx node '{node.name}')"


def _refuse(name: str, reason: str) -> None:
    raise KilnError(
        f"cannot prune the output channels of '{name}': {reason}; prune a plain conv stack, "
        "or leave 'channels' out of targets."
    )


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
