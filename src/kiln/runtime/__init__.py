"""Running artifacts: `kiln.Session` mirrors onnxruntime.InferenceSession."""

from kiln.runtime.session import Session

__all__ = ["Session"]
