"""The Python API reference: what `kiln` and `kiln.train` export, each name documented where it
is defined (found by importing it), so the page follows the code when a name moves.

`kiln.train` loads PyTorch on first use of its functions; rather than pay seconds of import on
every build, those names are found in LAZY (a name missing there fails the build)."""

from __future__ import annotations

import importlib
import inspect

PACKAGES = {
    "kiln": "The package: compile a model, open a session, the records of a compile.",
    "kiln.train": "Training: Kiln's loop (`fit`), your own loop (`prepare`), a checkpoint "
    "back into your module (`load`), and the `TrainConfig` every run takes.",
}
_LEFT_OUT = {"__version__", "require_torch", "read_config"}
LAZY = {
    "kiln.train.fit": "kiln.train.loop.fit",
    "kiln.train.load": "kiln.train.export.load",
    "kiln.train.prepare": "kiln.train.prepared.prepare",
    "kiln.train.Prepared": "kiln.train.prepared.Prepared",
}


def api_reference(level: int = 2) -> str:
    out = []
    for package, summary in PACKAGES.items():
        module = importlib.import_module(package)
        out.append("#" * level + f" `{package}`")
        out.append(summary)
        for name in sorted(set(module.__all__) - _LEFT_OUT, key=_order):
            out.append(_entry(package, name, _defined(module, package, name), level + 1))
    return "\n\n".join(out)


def _order(name: str) -> tuple[bool, str]:
    return (name[:1].isupper(), name.lower())  # functions first, then classes


def _defined(module: object, package: str, name: str) -> str:
    """Where `package.name` is defined, as a dotted path."""
    if f"{package}.{name}" in LAZY:
        return LAZY[f"{package}.{name}"]
    if package == "kiln.train" and name not in vars(module):
        raise LookupError(f"kiln.train.{name} loads lazily: name where it is defined in LAZY")
    value = getattr(module, name)
    if inspect.ismodule(value):  # a package callable as its namesake function (kiln.split)
        value = getattr(value, name, value)
    if inspect.ismodule(value):
        return value.__name__
    return f"{value.__module__}.{value.__qualname__}"


def _entry(package: str, name: str, defined: str, level: int) -> str:
    return "\n".join([
        f"::: {defined}",
        "    options:",
        f"      heading_level: {level}",
        f'      heading: "{package}.{name}"',
        f'      toc_label: "{package}.{name}"',
    ])  # fmt: skip
