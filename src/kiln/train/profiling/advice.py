"""Each speed finding's advice timed against the settings in use, in alternating blocks of
real steps, before it is given: advice measured not faster is withdrawn."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kiln.profile.finding import Finding
from kiln.timing import FASTER, Speedup, interleave, speedup
from kiln.train.profiling.diagnose import how
from kiln.train.profiling.measure import device_of, sync_for

AB_ROUNDS = 3  # alternating blocks a side: the fewest kiln.timing gives a verdict on
AB_STEPS = 2  # timed steps a block, after one untimed (the other side's threads and caches)
UNTRIED = "it needs another run to try; kiln train --tune measures it"


def try_advice(
    findings: list[Finding],
    run_step: Callable[[], None],
    advised_step: Callable[[dict[str, Any]], Callable[[], None] | None],
    model: torch.nn.Module,
) -> list[Finding]:
    """Each speed finding's advice timed against the settings in use, in alternating blocks
    of real steps (kiln.timing: interleaved rounds, the ratio of P50s, a verdict only when
    every round agrees). A peak ratio is not a speedup: bf16 kernels twice as fast in a GEMM
    can lose to autocast's casts in a small model's step. `advised_step(changes)` is
    `run_step` under the finding's changes, or None where this run cannot switch to them (a
    loader, a communication hook, another optimizer): that finding says it is untested.
    Advice measured not faster is withdrawn; its evidence stays. Every call trains."""
    sync = sync_for(device_of(model))

    def timed(step: Callable[[], None]) -> Callable[[], None]:
        return step if sync is None else lambda: (step(), sync())[-1]

    for finding in (f for f in findings if f.time_ms is not None):
        step = advised_step(finding.changes())
        if step is None:
            finding.measured = {"tried": False, "why": UNTRIED}
            finding.action += f" (untested: {UNTRIED})"
            continue
        runners = {"now": timed(run_step), "advised": timed(step)}
        samples = interleave(runners, rounds=AB_ROUNDS, runs=AB_STEPS, warmup=1)
        _judge(finding, speedup(samples["now"], samples["advised"]))
    return sorted(findings, key=_advice_first)


def _judge(finding: Finding, measured: Speedup) -> None:
    finding.measured = {"tried": True, **measured.to_json()}
    low, high = measured.spread or (measured.value, measured.value)
    figures = f"{measured.value:.2f}× ({low:.2f}–{high:.2f}, {measured.verdict})"
    if measured.verdict == FASTER:
        finding.action += f" — measured here {figures}"
    else:
        finding.action = (
            f"keep the settings in use: {how(finding.settings)} measured {figures} against "
            "them in alternating blocks of this run's steps"
        )


def _advice_first(finding: Finding) -> tuple[bool, bool, float]:
    withdrawn = bool(finding.measured and finding.measured.get("verdict") not in (None, FASTER))
    return withdrawn, finding.time_ms is None, -finding.share
