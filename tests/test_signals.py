"""SIGINT and SIGTERM (what Ctrl-C, `timeout`, systemd and Kubernetes send) stop the CLI with
one line and 128 + the signal number, leaving nothing behind — not even a hidden temporary
artifact directory. The signal is sent by the process to itself at a chosen step, so the test
does not depend on timing."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# Runs `kiln optimize zoo:resnet-tiny -o OUT` with the signal raised while the artifact is being
# written (inside onnx_ir.save, after the temporary directory exists).
SCRIPT = textwrap.dedent(
    """
    import os, sys
    import onnx_ir as ir
    real_save = ir.save

    def save(*args, **kwargs):
        real_save(*args, **kwargs)
        os.kill(os.getpid(), {signum})

    ir.save = save
    sys.argv = ["kiln", "optimize", "zoo:resnet-tiny", "-o", sys.argv[1], "--rounds", "0"]
    from kiln.cli import main
    main()
    """
)


@pytest.mark.parametrize(
    ("signum", "word"), [(signal.SIGINT, "interrupted"), (signal.SIGTERM, "terminated")]
)
def test_a_signal_while_writing_leaves_nothing_and_says_so(tmp_path, signum, word):
    out = tmp_path / "r.kiln"
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(signum=int(signum)), str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 128 + signum, result.stderr
    assert result.stderr.strip() == f"{word}; nothing was written."
    assert list(tmp_path.iterdir()) == []  # no artifact, no hidden .r.kiln.* directory


def test_a_bug_in_kiln_is_one_line_and_a_crash_report_not_a_traceback(monkeypatch, capsys):
    import kiln.cli as cli

    def broken() -> None:
        raise RuntimeError("something Kiln did not expect\nsecond line")

    monkeypatch.setattr(cli, "app", broken)
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == cli.INTERNAL_ERROR
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "internal error: RuntimeError: something Kiln did not" in lines[0]
    report = lines[0].rsplit("the traceback is in ", 1)[1]
    assert "Traceback" in Path(report).read_text()
