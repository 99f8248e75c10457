"""`kiln VERB --help` read in an 80-column terminal: prose reflowed to the width, not a
docstring's own line breaks wrapped again into ragged halves."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from kiln.cli import app

VERBS = [info.name or info.callback.__name__ for info in app.registered_commands]


def _prose(text: str) -> list[list[str]]:
    """The description's paragraphs (above the option boxes), command examples left out."""
    head = text.split("╭")[0].splitlines()
    paragraphs, current = [], []
    for line in [*head, ""]:
        if line.strip():
            current.append(line.rstrip())
            continue
        if current and not any(" kiln " in s[:7] or s.startswith("  ") for s in current):
            paragraphs.append(current)
        current = []
    return paragraphs


@pytest.mark.parametrize("verb", VERBS)
def test_help_prose_fills_an_80_column_terminal(verb: str) -> None:
    done = CliRunner().invoke(app, [verb, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert done.exit_code == 0, done.output
    for paragraph in _prose(done.output)[1:]:  # after the usage line
        ragged = [line for line in paragraph[:-1] if len(line) < 60]
        assert not ragged, "\n".join(paragraph)


def test_serve_max_batch_help_says_a_bigger_request_is_refused() -> None:
    done = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "200"}, terminal_width=200)
    text = " ".join(done.output.replace("│", " ").split())
    assert "a bigger request is refused (400)" in text, text
    assert "runs alone" not in text
