"""The CLI reference, generated from the Typer app: every verb, its help and every flag.

Read from the same command tree `kiln --help` prints, so the page cannot disagree with the CLI.
"""

from __future__ import annotations

import re

from docs_markdown import escape, inline

_DEFAULT = re.compile(r"\s*\[default: (?P<value>.*)\]\s*$")
_REQUIRED = re.compile(r"\s*\[required\]\s*$")


def cli_reference() -> str:
    """The markdown of every `kiln` verb, sub-verbs of a group included, in the CLI's order."""
    import typer

    from kiln.cli import app

    root = typer.main.get_command(app)
    context = _context(root, "kiln", None)
    out = [_verb_list(root), _command(root, context, "kiln", level=2, usage=False)]
    for name in root.list_commands(context):
        out.extend(_tree(root.get_command(context, name), context, f"kiln {name}", 2))
    return "\n\n".join(out)


def _tree(command, parent, path: str, level: int) -> list[str]:
    if command is None or command.hidden:
        return []
    context = _context(command, path.split()[-1], parent)
    out = [_command(command, context, path, level)]
    for name in getattr(command, "list_commands", lambda _c: [])(context):
        out.extend(_tree(command.get_command(context, name), context, f"{path} {name}", level + 1))
    return out


def _context(command, name: str, parent):
    # Typer carries its own copy of Click; a context is what help records are read through.
    return command.context_class(command, info_name=name, parent=parent)


def _verb_list(root) -> str:
    context = _context(root, "kiln", None)
    rows = ["| verb | what it does |", "| --- | --- |"]
    for name in root.list_commands(context):
        command = root.get_command(context, name)
        if command is None or command.hidden:
            continue
        summary = command.get_short_help_str(limit=200)
        rows.append(f"| [`kiln {name}`](#{_anchor(f'kiln {name}')}) | {inline(summary)} |")
    return "\n".join(rows)


def _command(command, context, path: str, level: int, usage: bool = True) -> str:
    heading = "#" * level + f" {path}" if usage else "#" * level + " Options of kiln itself"
    out = [heading + " {#" + _anchor(path if usage else "kiln-options") + "}"]
    if usage:
        out.append(_help_text(command.help or ""))
        out.append(f"```text\n{command.get_usage(context)}\n```")
    rows = [_param_row(param, context) for param in command.get_params(context)]
    rows = [row for row in rows if row]
    if rows:
        out.append("| argument or option | what it means | default |\n| --- | --- | --- |")
        out[-1] += "\n" + "\n".join(rows)
    return "\n\n".join(out)


def _param_row(param, context) -> str | None:
    if getattr(param, "hidden", False) or param.name == "help":  # -h, --help: every verb has it
        return None
    record = param.get_help_record(context)
    if record is None:
        return None
    names, text = record
    default = ""
    found = _DEFAULT.search(text)
    if found:
        default, text = found["value"], text[: found.start()]
    if _REQUIRED.search(text):
        text, default = _REQUIRED.sub("", text), "required"
    if param.param_type_name == "argument" and param.required:
        default = "required"
    return f"| `{names}` | {inline(text)} | {inline(default) if default else ''} |"


def _help_text(text: str) -> str:
    """A verb's help: prose paragraphs as text, command examples as a shell block."""
    paragraphs = [p for p in text.strip().split("\n\n") if p.strip()]
    return "\n\n".join(
        f"```bash\n{_dedent(p)}\n```" if _is_example(p) else _prose(p) for p in paragraphs
    )


def _is_example(paragraph: str) -> bool:
    lines = paragraph.splitlines()
    return any(line.startswith(("  ", "kiln ", "$ ")) or line.endswith("\\") for line in lines)


def _dedent(paragraph: str) -> str:
    import textwrap

    return textwrap.dedent(paragraph).replace("$ ", "", 1).strip("\n")


def _prose(text: str) -> str:
    return escape(" ".join(text.split()))


def _anchor(path: str) -> str:
    return path.replace(" ", "-")
