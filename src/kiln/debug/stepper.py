"""Where execution stands: how many nodes of the graph's topological order have run, and the
breakpoints. Pure bookkeeping: the tensors come from one exposed run of the whole graph
(`DebugSession`), revealed in this order, so stepping never reruns the engine.

A breakpoint stops execution *before* its node runs, as a debugger stops before a line:
`run` starts over and stops at the first breakpoint; `step` runs one node; `resume`
(continue) runs the node it stopped at and goes on to the next breakpoint or the end.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.errors import KilnError


@dataclass
class Stepper:
    order: list[str]  # node names, producers first
    breakpoints: set[str] = field(default_factory=set)
    position: int = 0  # nodes of `order` that have run

    def __post_init__(self) -> None:
        self._index = {name: i for i, name in enumerate(self.order)}

    def index(self, node: str) -> int:
        if node not in self._index:
            raise KilnError(f"no node '{node}' in the graph being run; pick one of its nodes.")
        return self._index[node]

    def ran(self, node: str) -> bool:
        return self.index(node) < self.position

    @property
    def next(self) -> str | None:
        """The node that runs next (execution is paused before it); None when finished."""
        return self.order[self.position] if self.position < len(self.order) else None

    def set_breakpoint(self, node: str, on: bool = True) -> None:
        self.index(node)  # an unknown node is refused
        if on:
            self.breakpoints.add(node)
        else:
            self.breakpoints.discard(node)

    def reset(self) -> None:
        self.position = 0

    def step(self) -> list[str]:
        """Run one node; the nodes that ran."""
        return self._advance(1)

    def run(self) -> list[str]:
        """Start over and run to the first breakpoint (or the end)."""
        self.reset()
        return self._to_breakpoint()

    def resume(self) -> list[str]:
        """Run the node execution stopped at, then on to the next breakpoint (or the end)."""
        return self._advance(1) + self._to_breakpoint()

    def _to_breakpoint(self) -> list[str]:
        start = self.position
        while self.position < len(self.order) and self.order[self.position] not in self.breakpoints:
            self.position += 1
        return self.order[start : self.position]

    def _advance(self, count: int) -> list[str]:
        start = self.position
        self.position = min(len(self.order), self.position + count)
        return self.order[start : self.position]

    def to_json(self) -> dict[str, Any]:
        return {
            "position": self.position,
            "total": len(self.order),
            "next": self.next,
            "done": self.position >= len(self.order),
            "breakpoints": sorted(self.breakpoints, key=self._index.__getitem__),
        }
