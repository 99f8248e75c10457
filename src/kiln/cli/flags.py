"""A verb's options generated from a record's fields, so that a flag and the Python API
cannot disagree on a default or drift apart in what they say.

A verb names a record where a parameter's default would go:

    @command
    def bench(model: ModelArg, config: Any = options(BenchConfig), as_json: JsonOpt = False):

and `command` gives Typer (which reads `inspect.signature`) one option per field instead: its
default the field's, its help the field's docstring (an attribute docstring, as mkdocstrings
reads it), its choices listed from `Flag.choices`. The verb is called with the record built
from the flags. `options(..., override=True)` is for flags laid over a base record read from a
file: each defaults to None and the verb gets only the fields given, {"path.to.field": value}.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import sys
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any

import typer

FIELD: Any = object()  # a Flag's default: the field's own


@dataclass(frozen=True)
class Flag:
    """How one field shows on the command line; every part optional."""

    names: tuple[str, ...] = ()  # e.g. ("-o", "--output"); default: --last-part-of-the-path
    help: str | None = None  # default: the field's docstring
    type: Any = None  # the flag's type where the field's is not one Typer reads
    parse: Callable[[Any], Any] | None = None  # the flag's value → the field's
    choices: tuple[str, ...] = ()  # listed in the help where it does not name them all
    default: Any = FIELD  # the flag's default where it cannot be the field's
    argument: bool = False  # a positional argument (named by `metavar`), not an option
    metavar: str | None = None


@dataclass(frozen=True)
class Options:
    """A record's fields as options: `flags` maps each field path shown to its Flag."""

    record: type
    flags: Mapping[str, Flag]
    override: bool = False
    panel: str | None = None

    def values(self, given: Mapping[str, Any]) -> Any:
        """The record (or, overriding, the fields given) from the flags' values by path."""
        parsed = {}
        for path, value in given.items():
            parse = self.flags[path].parse
            if self.override and value is None:
                continue
            parsed[path] = parse(value) if parse is not None and value is not None else value
        if self.override:
            return parsed
        return self.record(**parsed)

    def default(self, path: str) -> Any:
        """The record's own default for a field path."""
        return _field_default(self.record, path)


def options(
    record: type,
    *fields: str,
    flags: Mapping[str, Flag] | None = None,
    override: bool = False,
    panel: str | None = None,
) -> Any:
    """The fields of `record` to show (all when none are named), each as its Flag says."""
    flags = dict(flags or {})
    names = fields or tuple(f.name for f in dataclasses.fields(record))
    return Options(record, {name: flags.get(name, Flag()) for name in names}, override, panel)


def command(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with each parameter whose default is `options(...)` shown as the record's options
    and handed to `fn` as the record built from them."""
    hints = typing.get_type_hints(fn, include_extras=True)
    groups: dict[str, Options] = {}
    params: list[inspect.Parameter] = []
    for param in inspect.signature(fn).parameters.values():
        if isinstance(param.default, Options):
            groups[param.name] = param.default
            params += [_option(param.name, path, param.default) for path in param.default.flags]
        else:
            kind = inspect.Parameter.KEYWORD_ONLY if groups else param.kind  # after the options
            annotation = hints.get(param.name, param.annotation)
            params.append(param.replace(annotation=annotation, kind=kind))

    @functools.wraps(fn)
    def verb(**kwargs: Any) -> Any:
        for name, group in groups.items():
            given = {path: kwargs.pop(_param_name(name, path)) for path in group.flags}
            kwargs[name] = group.values(given)
        return fn(**kwargs)

    del verb.__wrapped__  # Typer must read the generated signature, not fn's
    verb.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    verb.__annotations__ = {p.name: p.annotation for p in params}
    verb.options = groups  # type: ignore[attr-defined]  # what the default test reads
    return verb


def _option(group: str, path: str, spec: Options) -> inspect.Parameter:
    flag = spec.flags[path]
    owner, name = _owner(spec.record, path)
    kind = flag.type or typing.get_type_hints(owner)[name]
    default = spec.default(path) if flag.default is FIELD else flag.default
    text = flag.help if flag.help is not None else _docs(owner).get(name, "")
    if flag.choices and not all(choice in text for choice in flag.choices):
        text = f"{text} One of: {', '.join(flag.choices)}.".strip()
    if spec.override:
        kind, default = kind | None, None
        shown = _shown(spec.default(path))
        text = f"{text} Default: the --config's, else {shown}.".strip()
    show = not spec.override and default not in (None, [])
    if flag.argument:
        option = typer.Argument(help=text, metavar=flag.metavar, show_default=show)
    else:
        long = "--" + name.replace("_", "-")
        # Typer's own for a bool: --x/--no-x
        names = flag.names or ((f"{long}/--no-{long[2:]}",) if kind is bool else (long,))
        option = typer.Option(*names, help=text, rich_help_panel=spec.panel, show_default=show,
                              metavar=flag.metavar)  # fmt: skip
    return inspect.Parameter(
        _param_name(group, path),
        inspect.Parameter.KEYWORD_ONLY,
        default=default,
        annotation=Annotated[kind, option],
    )


def _param_name(group: str, path: str) -> str:
    return f"{group}__{path.replace('.', '__')}"


def _shown(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def _owner(record: type, path: str) -> tuple[type, str]:
    """The dataclass that declares the last field of a dotted path, and that field's name."""
    *sections, name = path.split(".")
    for section in sections:
        record = typing.get_type_hints(record)[section]
    return record, name


def _field_default(record: type, path: str) -> Any:
    owner, name = _owner(record, path)
    (found,) = [f for f in dataclasses.fields(owner) if f.name == name]
    if found.default is not dataclasses.MISSING:
        return found.default
    if found.default_factory is not dataclasses.MISSING:
        return found.default_factory()
    raise TypeError(f"{owner.__name__}.{name} has no default: give it a Flag default.")


@functools.cache
def _docs(record: type) -> dict[str, str]:
    """Each field's attribute docstring (the string right under it in the class body), its
    lines joined, over the record and its bases."""
    docs: dict[str, str] = {}
    for klass in reversed(record.__mro__):
        body = _class_body(klass.__module__, klass.__qualname__)
        for node, after in zip(body, body[1:], strict=False):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                    and isinstance(after.value.value, str)):  # fmt: skip
                docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _class_body(module: str, name: str) -> list[ast.stmt]:
    """The statements of a module-level class, from its module's source ([] without one)."""
    for node in _module_tree(module).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node.body
    return []


@functools.cache
def _module_tree(module: str) -> ast.Module:
    """A module's syntax tree, parsed once (inspect.getsource would parse it per class)."""
    try:
        return ast.parse(inspect.getsource(sys.modules[module]))
    except (KeyError, OSError, TypeError):
        return ast.Module(body=[], type_ignores=[])


__all__ = ["FIELD", "Flag", "Options", "command", "options"]
