"""Kiln's pipeline runtime as a Triton Python-backend model: `kiln export --triton` of a
pipeline artifact copies this file to REPO/NAME/VERSION/model.py, beside the artifact in
artifact.kiln/ (the function's module file and each stage's artifact inside it).

It runs only inside Triton (`triton_python_backend_utils` is Triton's), in the Python
environment Triton starts the model in, which needs this Kiln and what the function's module
imports (see python_model.py: the same environment serves both).

The model is what `kiln serve` makes of a pipeline (kiln.pipeline.served.PipelineSession):
one BYTES input `input`, each element one query handed to the function as bytes, and one
BYTES output `output`, each query's result as JSON. The requests Triton's dynamic batcher
hands `execute` run together as streams, each stage's calls pooled across them. A request
refused or failing is answered with its error, the others still answered: a refusal (a
KilnError, as a failure inside the function becomes) is INVALID_ARG, which Triton's clients
read as HTTP 400 and gRPC INVALID_ARGUMENT; any other failure is INTERNAL (500).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

ARTIFACT = "artifact.kiln"
INPUT, OUTPUT = "input", "output"  # as kiln.pipeline.served's


class TritonPythonModel:
    """The model Triton's Python backend loads from model.py."""

    def initialize(self, args: dict[str, str]) -> None:
        try:
            import kiln
            from kiln.pipeline.served import PipelineSession
        except ImportError as exc:
            raise RuntimeError(
                f"Kiln cannot be imported in the Python environment Triton runs this model in "
                f"({exc}); install it there (kiln export --kserve writes a wheel of it and a "
                "Dockerfile that installs it), with numpy<2"
            ) from None
        self.refusal = kiln.KilnError  # the request's fault, as kiln serve judges it
        # args["model_repository"] is this model's directory, REPO/NAME.
        artifact = Path(args["model_repository"]) / args["model_version"] / ARTIFACT
        self.session = PipelineSession(str(artifact))

    def execute(self, requests: list[Any]) -> list[Any]:
        responses: list[Any] = [None] * len(requests)
        accepted: list[tuple[int, dict[str, np.ndarray]]] = []
        for i, request in enumerate(requests):
            try:  # checked one by one: a bad request must not fail the batch it came in
                accepted.append((i, self.session.check_feeds(_feeds(request))))
            except Exception as exc:
                responses[i] = self._error(exc)
        try:  # every query of every request, as streams together
            results = self.session.run_batch([feeds for _, feeds in accepted])
        except Exception:
            results = None  # one failing query must not fail its neighbours: run each alone
        for k, (i, feeds) in enumerate(accepted):
            try:
                outputs = results[k] if results is not None else self.session.run(None, feeds)
                responses[i] = _response(outputs[0])
            except Exception as exc:
                responses[i] = self._error(exc)
        return responses

    def finalize(self) -> None:
        self.session.close()

    def _error(self, exc: Exception) -> Any:
        """The response `kiln serve` gives the failure: its code and its message."""
        if isinstance(exc, self.refusal):
            return _error_response(str(exc), "INVALID_ARG")
        return _error_response(f"inference failed: {type(exc).__name__}: {exc}", "INTERNAL")


def _feeds(request: Any) -> dict[str, np.ndarray]:
    """The request's queries, as Triton hands BYTES over (bytes, not decoded: a query may be
    any bytes); a missing input is named by the session's checks."""
    tensor = pb_utils.get_input_tensor_by_name(request, INPUT)
    return {} if tensor is None else {INPUT: tensor.as_numpy()}


def _response(answers: np.ndarray) -> Any:
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(OUTPUT, answers)])


def _error_response(message: str, code: str) -> Any:
    message = " ".join(message.split())
    code_value = getattr(pb_utils.TritonError, code, None)  # None: Triton before 23.09
    error = (pb_utils.TritonError(message) if code_value is None
             else pb_utils.TritonError(message, code_value))  # fmt: skip
    return pb_utils.InferenceResponse(output_tensors=[], error=error)
