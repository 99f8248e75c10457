"""Kiln's runtime as a Triton Python-backend model: `kiln export --runtime kiln` copies this
file to REPO/NAME/VERSION/model.py, beside the artifact in artifact.kiln/.

It runs only inside Triton (`triton_python_backend_utils` is Triton's), in the Python
environment Triton starts the model in: the `python3` first on Triton's PATH, or the
EXECUTION_ENV_PATH the config names. That environment needs this Kiln (`kiln export --kserve`
writes a wheel of it and a Dockerfile that installs it), and, with Triton's stubs built
against numpy 1.x (as nvidia-pytriton 0.7.0's), numpy < 2.

Each request runs through one `kiln.Session` on the artifact, so its buckets, padding checks
and engine settings go along. Triton's dynamic batcher hands `execute` the requests it
gathered; the session merges them into one run where that is safe (Session.run_batch). A
request the session refuses, or whose run fails, is answered with its error; the others are
still answered. The error carries the code `kiln serve` answers the same failure with: a
refusal of the request (KilnError) is INVALID_ARG, which Triton's clients read as HTTP 400
and gRPC INVALID_ARGUMENT; any other failure is INTERNAL (500). Triton before 23.09 takes
no code: there every error is INTERNAL.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import triton_python_backend_utils as pb_utils

ARTIFACT = "artifact.kiln"


class TritonPythonModel:
    """The model Triton's Python backend loads from model.py."""

    def initialize(self, args: dict[str, str]) -> None:
        try:
            import kiln
        except ImportError as exc:
            raise RuntimeError(
                f"Kiln cannot be imported in the Python environment Triton runs this model in "
                f"({exc}); install it there (kiln export --kserve writes a wheel of it and a "
                "Dockerfile that installs it), with numpy<2"
            ) from None
        self.refusal = kiln.KilnError  # the request's fault, as kiln serve judges it
        config = json.loads(args["model_config"])
        # args["model_repository"] is this model's directory, REPO/NAME.
        artifact = Path(args["model_repository"]) / args["model_version"] / ARTIFACT
        self.session = kiln.Session(str(artifact))
        self.output_names = [spec["name"] for spec in config["output"]]
        self.input_names = [spec["name"] for spec in config["input"]]

    def execute(self, requests: list[Any]) -> list[Any]:
        responses: list[Any] = [None] * len(requests)
        accepted: list[tuple[int, dict[str, np.ndarray]]] = []
        for i, request in enumerate(requests):
            try:  # checked one by one: a bad request must not fail the batch it came in
                accepted.append((i, self.session.check_feeds(self._feeds(request))))
            except Exception as exc:
                responses[i] = self._error(exc)
        try:
            results = self.session.run_batch([feeds for _, feeds in accepted], self.output_names)
        except Exception:
            results = None  # one bad request must not fail its neighbours: run each alone
        for k, (i, feeds) in enumerate(accepted):
            try:
                outputs = results[k] if results is not None else self._run_alone(feeds)
                responses[i] = self._response(requests[i], outputs)
            except Exception as exc:
                responses[i] = self._error(exc)
        return responses

    def finalize(self) -> None:
        self.session.close()

    def _run_alone(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        return self.session.run_batch([feeds], self.output_names)[0]

    def _feeds(self, request: Any) -> dict[str, np.ndarray]:
        feeds = {}
        for name in self.input_names:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None:  # a missing input is named by the session's checks
                feeds[name] = _text(tensor.as_numpy())
        return feeds

    def _response(self, request: Any, outputs: list[np.ndarray]) -> Any:
        wanted = set(request.requested_output_names() or self.output_names)
        tensors = [
            pb_utils.Tensor(name, np.ascontiguousarray(value))
            for name, value in zip(self.output_names, outputs, strict=True)
            if name in wanted
        ]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def _error(self, exc: Exception) -> Any:
        """The response `kiln serve` gives the failure: its code and its message."""
        if isinstance(exc, self.refusal):
            return _error_response(str(exc), "INVALID_ARG")
        return _error_response(f"inference failed: {type(exc).__name__}: {exc}", "INTERNAL")


def _text(array: np.ndarray) -> np.ndarray:
    """Triton hands TYPE_STRING tensors over as bytes; the engines take ONNX strings as str."""
    if array.dtype != np.object_:
        return array
    decoded = [x.decode("utf-8") if isinstance(x, bytes) else x for x in array.ravel()]
    out = np.empty(len(decoded), dtype=object)
    out[:] = decoded
    return out.reshape(array.shape)


def _error_response(message: str, code: str) -> Any:
    message = " ".join(message.split())
    code_value = getattr(pb_utils.TritonError, code, None)  # None: Triton before 23.09
    error = (pb_utils.TritonError(message) if code_value is None
             else pb_utils.TritonError(message, code_value))  # fmt: skip
    return pb_utils.InferenceResponse(output_tensors=[], error=error)
