"""`kiln.Session(path).run(output_names, feeds)`, like an ONNX Runtime InferenceSession."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from kiln.artifact import read_artifact
from kiln.backends import get_backend, options_from_json
from kiln.errors import KilnError
from kiln.ir.inputs import check_feeds


class Session:
    """Loads an artifact with the backend settings recorded in its manifest."""

    def __init__(self, path: str | Path, **option_overrides: Any) -> None:
        self.artifact = read_artifact(path)
        backend = self.artifact.manifest["backend"]
        options = options_from_json(backend["name"], {**backend["options"], **option_overrides})
        # Only the graph's interface is needed for checks; weights stay on disk.
        self._interface = ir.load(str(self.artifact.model_path))
        self.executable = get_backend(backend["name"]).compile(
            str(self.artifact.model_path), options
        )

    @property
    def input_names(self) -> list[str]:
        return self.executable.input_names

    @property
    def output_names(self) -> list[str]:
        return self.executable.output_names

    def run(self, output_names: list[str] | None, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        check_feeds(self._interface, feeds, where=str(self.artifact.path))
        unknown = set(output_names or []) - set(self.output_names)
        if unknown:
            raise KilnError(
                f"unknown output '{sorted(unknown)[0]}'; the model's outputs are "
                f"{self.output_names}."
            )
        return self.executable.run(feeds, output_names)
