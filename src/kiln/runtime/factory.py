"""`kiln.runtime.Session(...)`: the session a model asks for, by what it is and where it runs.

A plain model or one-part artifact is a LocalSession (session.py); a partitioned artifact, each
part on its own engine, a PartitionedSession (parts.py); with `remote=`, the edge part of a
`kiln split` here and its server part on a `kiln serve` server, a RemoteSession (remote.py).
All three are SessionLike (protocol.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kiln.artifact.parts import is_partitioned
from kiln.errors import KilnError
from kiln.runtime.parts import PartitionedSession
from kiln.runtime.remote import RemoteSession
from kiln.runtime.session import LocalSession


def Session(  # noqa: N802 (named as the class it stands for, as in onnxruntime)
    path_or_model: str | Path,
    sess_options: Any = None,
    providers: list[Any] | None = None,
    provider_options: list[dict[str, Any]] | None = None,
    *,
    backend: str | None = None,
    buckets: dict[str, list[int]] | str | None = None,
    warmup: bool = False,
    adaptive: bool = False,
    share_weights: bool = True,
    options: dict[str, Any] | None = None,
    keep_requests: int = 0,
    steady: bool = True,
    remote: str | None = None,
    model_name: str | None = None,
    timeout: float | None = None,
    link_bandwidth: float | None = None,
) -> LocalSession | PartitionedSession | RemoteSession:
    """Open `path_or_model` (an artifact NAME.kiln, a plain .onnx file or zoo:NAME) to run as
    onnxruntime.InferenceSession runs: LocalSession says what each setting does; a partitioned
    artifact refuses the ones it does not offer, each with a message.

    With `remote="http://host:port"` (and optionally `model_name=`, the name the server serves
    the split's server part under, `timeout=` seconds, default 30, and `link_bandwidth=`
    bits/s): the edge part of a `kiln split` here and the server part there, with the same
    `run`, `run_batch` and `stats`."""
    here = {
        "sess_options": sess_options, "providers": providers,
        "provider_options": provider_options, "backend": backend, "buckets": buckets,
        "warmup": warmup, "adaptive": adaptive, "share_weights": share_weights,
        "options": options, "keep_requests": keep_requests, "steady": steady,
    }  # fmt: skip
    settings = {"model_name": model_name, "timeout": timeout, "link_bandwidth": link_bandwidth}
    settings = {name: value for name, value in settings.items() if value is not None}
    if remote is None:
        for name in settings:
            raise KilnError(f"{name}= is for a remote session; give remote= too.")
        return _open_here(path_or_model, here)
    edge = _open_here(path_or_model, here)
    try:
        return RemoteSession(edge, remote, **settings)
    except BaseException:
        edge.close()  # not an edge part, or a bad setting: nothing is left open
        raise


def _open_here(
    path_or_model: str | Path, settings: dict[str, Any]
) -> LocalSession | PartitionedSession:
    if isinstance(path_or_model, str | Path) and is_partitioned(path_or_model):
        # several parts, each its own engine: run at once where they can (parts.py)
        return PartitionedSession(path_or_model, **settings)
    return LocalSession(path_or_model, **settings)
