"""Running models: `kiln.runtime.Session(...)` opens a model as onnxruntime.InferenceSession
does and returns the session it needs (factory.py): a LocalSession with shape buckets, a load
monitor, background recompilation and hot swap; a PartitionedSession; or a RemoteSession.
All three are SessionLike (protocol.py)."""

from kiln.runtime.buckets import format_buckets, parse_buckets
from kiln.runtime.factory import Session
from kiln.runtime.parts import PartitionedSession
from kiln.runtime.protocol import SessionLike
from kiln.runtime.remote import RemoteSession
from kiln.runtime.session import LocalSession

__all__ = [
    "LocalSession",
    "PartitionedSession",
    "RemoteSession",
    "Session",
    "SessionLike",
    "format_buckets",
    "parse_buckets",
]
