"""The Backend contract every engine implements (see DESIGN.md)."""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import onnx_ir as ir


class Executable(Protocol):
    """A model compiled for one engine, ready to run."""

    input_names: list[str]
    output_names: list[str]

    def run(
        self, feeds: dict[str, np.ndarray], output_names: list[str] | None = None
    ) -> list[np.ndarray]: ...

    def profile(self, feeds: dict[str, np.ndarray], runs: int) -> list[dict[str, Any]]: ...


class Backend(Protocol):
    name: str

    def available(self) -> bool: ...

    def describe(self) -> dict[str, str]: ...

    def compile(self, model: ir.Model | str, options: Any = None) -> Executable: ...
