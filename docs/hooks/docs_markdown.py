"""Plain text from docstrings and help as markdown: what the generated pages share."""

from __future__ import annotations

import re

_CODE = re.compile(r"(`[^`]*`)")


def escape(text: str) -> str:
    """Angle brackets, asterisks, underscores and square brackets are plain text in a
    docstring or a help, not markup; `code` spans stay as they are."""
    return "".join(
        part if part.startswith("`") else _escape_plain(part) for part in _CODE.split(text)
    )


def _escape_plain(text: str) -> str:
    text = text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return re.sub(r"([*_\[\]])", r"\\\1", text)


def inline(text: str) -> str:
    """One table cell: whitespace folded, pipes escaped."""
    return escape(" ".join(text.split())).replace("|", "\\|")


def paragraphs(text: str) -> str:
    """Each paragraph's lines joined, paragraphs kept apart."""
    return "\n\n".join(escape(" ".join(p.split())) for p in text.split("\n\n") if p.strip())
