"""The configuration reference, generated from the config records: every field of
`CompileConfig`, `TimingConfig`, `TuneConfig`, `ServeConfig` and `TrainConfig` (and the
records `TrainConfig` nests), with its type, its default and what its docstrings say of it.

A field's text comes, first found: from `field(metadata={"help": ...})`; from a string literal
right below the field; from the class docstring's entry naming it (`name  text`, or
`a, b  text` for several); from an entry that names a group of fields in its text.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import textwrap
from typing import Any

from docs_markdown import inline, paragraphs

RECORDS = [
    ("kiln.config", "CompileConfig"),
    ("kiln.config", "TimingConfig"),
    ("kiln.tune.plan", "TuneConfig"),
    ("kiln.serve.config", "ServeConfig"),
    ("kiln.train.config", "TrainConfig"),
    ("kiln.train.config", "LossScale"),
    ("kiln.train.config", "Checkpointing"),
    ("kiln.train.config", "Parallel"),
    ("kiln.train.config", "Loader"),
]
_ENTRY = re.compile(r"^(?P<names>[a-z_][\w, ]*?)\s{2,}(?P<text>\S.*)$")


class Undocumented(Exception):
    """A config field whose text was found nowhere: the reference would have a hole."""


def config_reference(level: int = 2) -> str:
    """The markdown of every record in RECORDS: a heading, its docstring, a table of fields."""
    return "\n\n".join(_record(*where, level=level) for where in RECORDS)


def _record(module: str, name: str, level: int) -> str:
    cls = getattr(importlib.import_module(module), name)
    summary, entries, rest = _docstring(cls)
    fields = dataclasses.fields(cls)
    texts = _field_texts(cls, fields, entries)
    prose = f"{summary} {rest}"
    missing = [f.name for f in fields if not texts.get(f.name) and not _named_in(f.name, prose)]
    if missing:
        raise Undocumented(f"{module}.{name}: no text for {', '.join(missing)}")
    out = ["#" * level + f" {name} {{#{name.lower()}}}", f"`{module}.{name}`", summary]
    if rest:
        out.append(rest)
    rows = ["| field | type | default | what it decides |", "| --- | --- | --- | --- |"]
    for field in fields:
        text = texts.get(field.name) or "see above"
        kind = inline(_type_name(field.type))
        rows.append(f"| `{field.name}` | {kind} | {_default(field)} | {inline(text)} |")
    out.append("\n".join(rows))
    return "\n\n".join(part for part in out if part)


def _docstring(cls: type) -> tuple[str, dict[str, str], str]:
    """The summary, the `name  text` entries, and the prose left over."""
    doc = inspect.cleandoc(cls.__doc__ or "")
    summary, _, body = doc.partition("\n\n")
    entries: dict[str, str] = {}
    prose: list[str] = []
    current = None
    for line in body.splitlines():
        found = _ENTRY.match(line)
        if found and not line.startswith(" "):
            current = found["names"]
            entries[current] = found["text"]
        elif current is not None and line.startswith(" ") and line.strip():
            entries[current] += " " + line.strip()
        else:
            current = None
            prose.append(line)
    return " ".join(summary.split()), entries, paragraphs("\n".join(prose))


def _field_texts(cls: type, fields: Any, entries: dict[str, str]) -> dict[str, str]:
    texts: dict[str, str] = {}
    literal = _attribute_docstrings(cls)
    for field in fields:
        given = field.metadata.get("help") or field.metadata.get("doc") or literal.get(field.name)
        if given:
            texts[field.name] = " ".join(str(given).split())
    for names, text in entries.items():
        listed = [n.strip() for n in names.split(",")]
        for name in listed:
            texts.setdefault(name, text if len(listed) == 1 else f"{', '.join(listed)}: {text}")
    for names, text in entries.items():  # an entry naming the field ("ddp  bucket_mb, ...")
        for field in fields:
            if _named_in(field.name, text):
                texts.setdefault(field.name, f"(with {names}) {text}")
    return texts


def _attribute_docstrings(cls: type) -> dict[str, str]:
    """Field name → the string literal written right below its annotation, if any."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    found = {}
    for node, after in zip(body, body[1:], strict=False):
        is_field = isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        is_text = isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
        if is_field and is_text and isinstance(after.value.value, str):
            found[node.target.id] = inspect.cleandoc(after.value.value)
    return found


def _named_in(name: str, text: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", text) is not None


def _default(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        return "required"
    if dataclasses.is_dataclass(value):
        name = type(value).__name__
        return f"[{name}()](#{name.lower()})"
    return inline(f"`{value!r}`")


def _type_name(annotation: Any) -> str:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", "")
    return f"`{text or annotation}`"
