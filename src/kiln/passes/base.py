"""The base of every Kiln pass: an onnx_ir in-place pass that counts what it changed."""

from __future__ import annotations

import abc

import onnx_ir as ir


class KilnPass(ir.passes.InPlacePass):
    """Subclasses set `name` and implement `apply`, returning how many rewrites they made."""

    name: str = "unnamed"
    stage: str = "simplify"
    summary: str = ""  # one line for `--show-pipeline`
    count: int = 0  # rewrites made by the last call
    # Engines that can run what the pass emits; None: any (it emits standard ONNX only).
    engines: frozenset[str] | None = None

    @abc.abstractmethod
    def apply(self, model: ir.Model) -> int:
        """Rewrite `model` in place; return how many rewrites were made."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.count = self.apply(model)
        return ir.passes.PassResult(model, modified=self.count > 0)
