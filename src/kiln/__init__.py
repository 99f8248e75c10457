"""Kiln: a hardware-aware graph compiler and performance toolkit for neural-network models.

`import kiln` is light: the compiler, the runtime and the engines load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pathlib import Path

__version__ = "0.1.0"

_LAZY = {
    "CompileConfig": ("kiln.config", "CompileConfig"),
    "KilnError": ("kiln.errors", "KilnError"),
    "Pipeline": ("kiln.pipeline", "Pipeline"),  # a pipeline function and its models, run
    "compile_pipeline": ("kiln.pipeline", "compile_pipeline"),
    # an edge part and a server part (kiln split): the package, callable as its `split`
    "split": ("kiln.split", None),
}


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
    feedback: bool = False,
    feedback_options: dict[str, Any] | None = None,
) -> Any:  # kiln.runtime's LocalSession | PartitionedSession | RemoteSession
    """`kiln.runtime.Session`: a model opened to run as onnxruntime.InferenceSession runs (a
    LocalSession, or a PartitionedSession or RemoteSession where the model asks for one, see
    there). With `feedback=True`, a kiln.tune FeedbackLoop tunes it from its live traffic
    (`feedback_options`: the loop's keyword arguments; `.feedback` is the loop, stopped by
    `close`); the session then keeps its recent requests for the loop to replay
    (kiln.tune.feedback.KEEP_REQUESTS of them, unless `keep_requests` says)."""
    if feedback:
        _load("kiln.tune.feedback", "check_tunable")(path_or_model, remote)
        keep_requests = keep_requests or _load("kiln.tune.feedback", "KEEP_REQUESTS")
    session = _load("kiln.runtime", "Session")(
        path_or_model, sess_options, providers, provider_options, backend=backend,
        buckets=buckets, warmup=warmup, adaptive=adaptive, share_weights=share_weights,
        options=options, keep_requests=keep_requests, steady=steady, remote=remote,
        model_name=model_name, timeout=timeout, link_bandwidth=link_bandwidth,
    )  # fmt: skip
    if feedback:
        loop = _load("kiln.tune.feedback", "FeedbackLoop")
        try:
            session.feedback = loop(session, **(feedback_options or {})).start()
        except BaseException:
            session.close()  # a loop that cannot start leaves nothing open
            raise
    return session


def _compile() -> Any:
    """`kiln.compile`: kiln.compiler's compile with kiln.partition's builder handed in (the
    compiler may not import the layer above it); its signature and help are the compiler's."""
    import functools
    import inspect

    compile_ = _load("kiln.compiler", "compile")
    builder = _load("kiln.partition", "compile_partitioned")

    @functools.wraps(compile_)
    def compile(*args: Any, **kwargs: Any) -> Any:  # kiln.compile, as documented
        return compile_(*args, partitioned=builder, **kwargs)

    signature = inspect.signature(compile_)
    compile.__signature__ = signature.replace(  # type: ignore[attr-defined]
        parameters=[p for p in signature.parameters.values() if p.name != "partitioned"]
    )
    return compile


def _load(module: str, name: str | None) -> Any:
    """`module.name` (None: the module), imported on first use, and by name: the packages that
    import `kiln` for its __version__ must not count as importing what it loads (the
    import-linter layers)."""
    import importlib

    loaded = importlib.import_module(module)
    return loaded if name is None else getattr(loaded, name)


def __getattr__(name: str) -> Any:
    if name == "compile":
        value = globals()["compile"] = _compile()
        return value
    if name not in _LAZY:
        raise AttributeError(f"module 'kiln' has no attribute '{name}'")
    value = _load(*_LAZY[name])
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY, "compile"])


__all__ = [
    "CompileConfig", "KilnError", "Pipeline", "Session", "__version__", "compile",
    "compile_pipeline", "split",
]  # fmt: skip
