"""A measurement in a Python process of its own: the parent runs `python -m MODULE ARGS` and
reads the one JSON line the child prints last (`{"error": ...}` when it failed), so nothing in
the parent's heap counts in what the child measures."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

from kiln.errors import KilnError


def run_child(module: str, args: list[str], what: str, timeout_s: float) -> dict[str, Any]:
    """The child's answer; KilnError naming `what` ("measuring the memory of X") and why when
    it fails, hangs past `timeout_s` or prints no answer."""
    command = [sys.executable, "-m", module, *args]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise KilnError(f"{what}: no answer in {timeout_s:g} s.") from None
    lines = done.stdout.strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if lines else {}
    except ValueError:
        answer = {}
    if done.returncode != 0 or "error" in answer or not answer:
        why = answer.get("error") or (done.stderr.strip().splitlines() or ["no answer"])[-1]
        raise KilnError(f"{what}: {why}")
    return answer


def child_main(measure: Callable[[list[str]], dict[str, Any]], argv: list[str]) -> int:
    """The child's side: print `measure(argv)` as one JSON line, or the KilnError it raised."""
    try:
        answer = measure(argv)
    except KilnError as exc:
        print(json.dumps({"error": " ".join(str(exc).split())}))
        return 2
    print(json.dumps(answer))
    return 0
