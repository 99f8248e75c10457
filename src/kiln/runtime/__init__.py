"""Running models: `kiln.Session` mirrors onnxruntime.InferenceSession, with shape buckets,
a load monitor, background recompilation and hot swap."""

from kiln.runtime.buckets import format_buckets, parse_buckets
from kiln.runtime.session import Session

__all__ = ["Session", "format_buckets", "parse_buckets"]
