"""`kiln ARGS` run in the test's own process, for tests that read a verb's exit code and
output without the seconds a fresh interpreter costs."""

from __future__ import annotations

import signal
import sys

import pytest

from kiln.cli import main


def kiln_cli(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """`kiln ARGS` in this process: exit code, stdout, stderr."""
    monkeypatch.setattr(sys, "argv", ["kiln", *args])
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with pytest.raises(SystemExit) as exited:
            main()
    finally:
        for signum, handler in handlers.items():  # main() installs its own
            signal.signal(signum, handler)
    captured = capsys.readouterr()
    return exited.value.code, captured.out, captured.err
