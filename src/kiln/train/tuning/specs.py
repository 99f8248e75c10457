"""How trial processes reach the user's functions (model, data, loss, optimizer): by their
importable `module:function` name, else pickled; and the model's facts the tuner needs, read
once here."""

from __future__ import annotations

import importlib
import pickle
import types
from collections import Counter
from pathlib import Path
from typing import Any

from kiln.errors import KilnError


def spec_name(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    from kiln.compress.loading import spec_of

    return spec_of(value)


def trial_ref(value: Any, name: str, folder: Path) -> dict[str, str] | None:
    """How a trial process finds `value`: its importable `module:function`, else a pickle."""
    if value is None:
        return None
    from kiln.compress.loading import load_callable, spec_of

    if isinstance(value, str):
        load_callable(value, f"the {name}")  # a bad name is refused before any trial
        return {"spec": value}
    spec = spec_of(value)
    if _importable(spec, value):
        return {"spec": spec}
    if isinstance(value, types.FunctionType | types.MethodType):
        raise KilnError(f"the {name} {spec} cannot be imported by the trial processes: make it "
                        "a module-level function (module:function), not a lambda or a "
                        "function of __main__.")  # fmt: skip
    path = folder / f"{name}.pkl"
    try:
        with open(path, "wb") as file:
            pickle.dump(value, file)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise KilnError(f"the {name} {spec} cannot reach the trial processes ({exc}); give a "
                        "module:function that builds it.") from None  # fmt: skip
    return {"pickle": str(path)}


def _importable(spec: str, value: Any) -> bool:
    module_name, _, qualname = spec.partition(":")
    if not qualname or module_name == "__main__" or "<" in qualname:
        return False
    try:
        found: Any = importlib.import_module(module_name)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return False
    return found is value


def inspect_model(model: Any, seed: int) -> dict[str, Any]:
    """Built once here, seeded, then dropped: how many repeated blocks it has (what
    checkpointing can wrap) and its signature for the library."""
    from torch import nn

    from kiln.compress.loading import call, load_callable
    from kiln.train.memory import find_blocks
    from kiln.train.trial import Seeded

    if isinstance(model, str):
        model = load_callable(model, "model")
    module = model if isinstance(model, nn.Module) else call(
        Seeded(model, seed), "the model factory", nn.Module, "a torch.nn.Module")  # fmt: skip
    return {"blocks": len(find_blocks(module)), "signature": signature(module)}


def signature(module: Any) -> dict[str, Any]:
    """A torch model's signature as kiln.tune.signature.distance reads one: the mix of leaf
    module types, and 2 × the weights of its Linear (matmul) and Conv (conv) layers — their
    FLOPs per input position — and its parameters."""
    from torch import nn

    leaves = [m for m in module.modules() if not any(True for _ in m.children())]
    kinds = Counter(type(m).__name__ for m in leaves)
    total = sum(kinds.values()) or 1
    conv = sum(m.weight.numel() for m in leaves if isinstance(m, nn.modules.conv._ConvNd))
    matmul = sum(m.weight.numel() for m in leaves if isinstance(m, nn.Linear))
    return {
        "ops": {k: v / total for k, v in sorted(kinds.items())}, "nodes": total,
        "flops": {"conv": 2 * conv, "matmul": 2 * matmul},
        "parameters": sum(p.numel() for p in module.parameters()), "dynamic_dims": [],
    }  # fmt: skip
