"""Start training ranks: torchrun's own launcher (`elastic_launch`), called from Python.

`launch(entry, args, nproc)` runs `entry(*args)` in `nproc` spawned processes that find each
other through a c10d rendezvous, and returns each rank's return value. A rank that raises or
dies ends the whole job, and the job's failure comes back as one `KilnError` line naming the
rank that failed first and why — the elastic agent's failure records, read rather than dumped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import re
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as torch_dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure
from torch.distributed.elastic.rendezvous import RendezvousError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from kiln.errors import KilnError

# How often the agent looks at its ranks: a failure is seen this soon after it happens.
MONITOR_INTERVAL_S = 0.2
# After one rank fails the agent sends the others SIGTERM, and SIGKILL this much later.
SHUTDOWN_TIMEOUT_S = 10
# Rendezvous: how long the nodes may take to join, and a store read may wait.
RENDEZVOUS_TIMEOUT_S = 60.0
# A rank whose collective failed because a peer died waits this long for the agent to stop
# it, so that the report names the peer (see _run_rank); then it exits by itself.
PEER_FAILURE_GRACE_S = 10.0
# gloo's words for a peer that went away mid-collective.
_PEER_FAILURE = re.compile(
    r"connection closed by peer|connection reset by peer|read error|broken pipe|remote worker",
    re.IGNORECASE,
)
_MESSAGE_CHARS = 300
# The signals the agent handles itself while the job runs (TORCHELASTIC_SIGNALS_TO_HANDLE).
_AGENT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
# The loggers of torchrun's agent (a logger's `disabled` is its own, not its children's).
_AGENT_LOGGERS = (
    "torch.distributed.elastic",
    "torch.distributed.launcher",
    "torch.multiprocessing",
)


def launch(
    entry: Callable[..., Any],
    args: tuple[Any, ...],
    nproc: int,
    *,
    nnodes: str = "1",
    rdzv_endpoint: str | None = None,
    timeout_s: float = RENDEZVOUS_TIMEOUT_S,
) -> dict[int, Any]:
    """Run `entry(*args)` on `nproc` ranks of this node; return {global rank: return value}.

    `entry` must be a module-level function (the ranks are spawned and unpickle it), and its
    arguments and return values picklable. `nnodes` is torchrun's "N" or "MIN:MAX"; with one
    node the rendezvous is hosted here on `rdzv_endpoint` (default: a free localhost port).
    `timeout_s` bounds the rendezvous: nodes that have not joined by then end the job.
    """
    _check_picklable(entry)
    if not isinstance(nproc, int) or nproc < 1:
        raise KilnError(f"nproc {nproc!r}: give the number of ranks on this node, ≥ 1.")
    min_nodes, max_nodes = _node_range(nnodes)
    if max_nodes > 1 and not rdzv_endpoint:
        raise KilnError(
            f"nnodes {nnodes}: the nodes meet at a rendezvous endpoint; give the same "
            "host:port (e.g. node0:29400) on every node."
        )
    endpoint = rdzv_endpoint or f"localhost:{_free_port()}"
    config = LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc,
        run_id=f"kiln-{uuid.uuid4().hex[:12]}",
        rdzv_endpoint=endpoint,
        rdzv_backend="c10d",
        rdzv_configs=_rendezvous_configs(max_nodes, timeout_s),
        max_restarts=0,
        monitor_interval=MONITOR_INTERVAL_S,
        start_method="spawn",
        shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )
    with (
        tempfile.TemporaryDirectory(prefix="kiln-ranks-") as logs,
        _quiet_agent(),
        _callers_signal_handlers(),
    ):
        # The ranks' error files live here, and go once the failure has been read.
        config.logs_specs = DefaultLogsSpecs(log_dir=logs)
        try:
            return elastic_launch(config, _run_rank)(entry, *args)
        except ChildFailedError as exc:
            stopped = _stopped_by(exc.failures)
            if stopped is None:
                raise KilnError(describe_failure(exc.failures)) from None
        except RendezvousError as exc:
            raise KilnError(_rendezvous_problem(endpoint, exc)) from None
        except SignalException as exc:  # the agent stopped its ranks before raising this
            stopped = signal.Signals(exc.sigval)
    # Every rank has ended. The stop goes on as the signal itself, to the caller's handler:
    # the CLI's says which checkpoint survived it, a script gets its KeyboardInterrupt.
    signal.raise_signal(stopped)
    raise KilnError(f"training stopped by {stopped.name}; every rank was ended.")


def _stopped_by(failures: dict[int, ProcessFailure]) -> signal.Signals | None:
    """The signal that stopped the job from outside where its ranks died of it before the
    agent saw it: Ctrl-C reaches every rank of the terminal's process group (SIGINT), a
    scheduler ends every process with SIGTERM. None where a rank failed."""
    _, first = min(failures.items(), key=lambda item: _root_cause_order(*item))
    if first.exitcode == -signal.SIGINT:
        return signal.SIGINT
    if all(failure.exitcode == -signal.SIGTERM for failure in failures.values()):
        return signal.SIGTERM
    return None


@contextlib.contextmanager
def _callers_signal_handlers() -> Iterator[None]:
    """The agent installs handlers of its own for these signals (they raise SignalException)
    and leaves them installed; the caller's come back when the job ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    kept = {signum: signal.getsignal(signum) for signum in _AGENT_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in kept.items():
            if handler is not None:
                signal.signal(signum, handler)


def describe_failure(failures: dict[int, ProcessFailure]) -> str:
    """One line: the rank that failed first and why (exception and where, or signal)."""
    rank, failure = min(failures.items(), key=lambda item: _root_cause_order(*item))
    others = len(failures) - 1
    also = f"; {others} other rank{'s' if others > 1 else ''} failed after it" if others else ""
    return f"rank {rank} {_what_happened(failure)}{also}."


def _run_rank(entry: Callable[..., Any], *args: Any) -> Any:
    """Each rank's top level. An exception is written to the agent's error file, with the
    time to the microsecond and the place, and the rank exits 1 without printing a traceback
    (the launcher reports it as one line) and without interpreter shutdown, whose destructors
    can hang on a process group a failed step left busy. A rank that returns has its group,
    if kiln.train.parallel.setup made it, ended here (teardown is idempotent)."""
    # A Ctrl-C reaches every rank of the terminal's process group: a rank ends at once and
    # quietly (the launcher reports the stop once; no traceback per rank, no destructor that
    # hangs on a busy group). A checkpoint it was writing stays partial, and is never read.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    try:
        result = entry(*args)
    except Exception as exc:
        peer = peer_failed(exc)
        _record(exc, peer)
        sys.stdout.flush()
        sys.stderr.flush()
        if peer:
            # The agent reports the first dead rank it sees; it sees the peer's death at its
            # next look and stops this rank then. Exiting at once would put this rank first.
            time.sleep(PEER_FAILURE_GRACE_S)
        os._exit(1)
    from kiln.train import parallel  # only now: launch serves entries without a group too

    parallel.teardown()
    return result


def peer_failed(exc: BaseException) -> bool:
    """Whether a collective failed because another rank died (gloo's socket errors)."""
    return isinstance(exc, torch_dist.DistError) or bool(_PEER_FAILURE.search(str(exc)))


def _record(exc: Exception, peer: bool) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    now = time.time()
    # A KilnError is already the one line for the user, the place included where it matters.
    ours = isinstance(exc, KilnError)
    data = {
        "message": {
            "message": str(exc) if ours else f"{type(exc).__name__}: {exc}",
            "extraInfo": {
                "py_callstack": traceback.format_exc(),
                "timestamp": str(int(now)),
                "kiln_time": now,
                "kiln_where": "" if ours else _where(exc),
                "kiln_error": ours,
                "kiln_peer_failed": peer,
            },
        }
    }
    if path:
        with open(path, "w") as file:
            json.dump(data, file)
    else:  # not under the agent: keep the story on stderr
        print(f"{data['message']['message']} ({_where(exc)})", file=sys.stderr)


def _where(exc: BaseException) -> str:
    """file:line of the innermost frame outside PyTorch (the user's or Kiln's code)."""
    frames = traceback.extract_tb(exc.__traceback__)
    torch_dir = os.sep + "torch" + os.sep
    ours = [frame for frame in frames if torch_dir not in frame.filename] or frames
    if not ours:
        return ""
    return f"{os.path.basename(ours[-1].filename)}:{ours[-1].lineno}"


def _root_cause_order(rank: int, failure: ProcessFailure) -> tuple[int, int, float, int]:
    """Killed by a signal first (a rank dies of a signal only from outside; its peers then
    fail with exceptions), then failures of the rank's own, then those of a collective whose
    peer died; within each the earliest, then the lowest rank."""
    killed = failure.exitcode < 0 and failure.exitcode != -signal.SIGTERM
    peer = bool(_info(failure).get("kiln_peer_failed"))
    return (0 if killed else 1, 1 if peer else 0, _exact_time(failure), rank)


def _exact_time(failure: ProcessFailure) -> float:
    info = _info(failure)
    return float(info.get("kiln_time", failure.timestamp))


def _info(failure: ProcessFailure) -> dict[str, Any]:
    message = failure.error_file_data.get("message")
    return message.get("extraInfo", {}) if isinstance(message, dict) else {}


def _what_happened(failure: ProcessFailure) -> str:
    if failure.exitcode < 0:
        return f"was killed by {failure.signal_name()} (signal {-failure.exitcode})"
    message = failure.error_file_data.get("message")
    if isinstance(message, dict):
        message = message.get("message")
    if not message or message == "<NONE>":  # the agent's placeholder when no file was written
        return (
            f"exited with code {failure.exitcode} before recording an error (its output says "
            'why; a script that launches ranks needs an `if __name__ == "__main__":` guard)'
        )
    text = " ".join(str(message).split()).rstrip(".")
    if len(text) > _MESSAGE_CHARS and not _info(failure).get("kiln_error"):  # Kiln's is whole
        text = text[: _MESSAGE_CHARS - 1] + "…"
    info = _info(failure)
    where = info["kiln_where"] if "kiln_where" in info else _where_from_stack(info)
    return f"failed: {text}" + (f" (at {where})" if where else "")


def _where_from_stack(info: dict[str, Any]) -> str:
    # Error files written by torch's own @record carry only the formatted traceback.
    places = re.findall(r'File "([^"]+)", line (\d+)', str(info.get("py_callstack", "")))
    return f"{os.path.basename(places[-1][0])}:{places[-1][1]}" if places else ""


def _check_picklable(entry: Callable[..., Any]) -> None:
    try:
        pickle.dumps(entry)
    except (pickle.PicklingError, AttributeError, TypeError):
        name = getattr(entry, "__qualname__", repr(entry))
        raise KilnError(
            f"launch: the entry {name} cannot be sent to the ranks; define it at module level "
            "(not a lambda or a nested function)."
        ) from None


def _node_range(nnodes: str) -> tuple[int, int]:
    match = re.fullmatch(r"\s*(\d+)\s*(?::\s*(\d+)\s*)?", str(nnodes))
    if not match or int(match.group(1)) < 1 or int(match.group(2) or 1) < 1:
        raise KilnError(f"nnodes '{nnodes}': use a node count N or a range MIN:MAX, e.g. 1 or 2:4.")
    low = int(match.group(1))
    high = int(match.group(2) or low)
    if high < low:
        raise KilnError(f"nnodes '{nnodes}': MIN is above MAX; use e.g. 2:4.")
    return low, high


def _rendezvous_configs(max_nodes: int, timeout_s: float) -> dict[str, Any]:
    seconds = max(1, int(timeout_s))
    configs: dict[str, Any] = {"timeout": seconds, "read_timeout": seconds}
    if max_nodes == 1:
        # One node hosts its own store: a port in use must fail now, not be retried as a
        # client of whatever holds it until the read timeout.
        configs["is_host"] = True
    return configs


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("localhost", 0))
        return int(probe.getsockname()[1])


def _rendezvous_problem(endpoint: str, exc: BaseException) -> str:
    causes = []
    cause: BaseException | None = exc
    while cause is not None:  # the store's own error is a few causes down
        causes.append(str(cause))
        cause = cause.__cause__ or cause.__context__
    text = " ".join(causes)
    if "EADDRINUSE" in text or "address already in use" in text.lower():
        return (
            f"rendezvous endpoint {endpoint}: the port is already in use; choose a free port "
            "(or leave the endpoint unset on one node)."
        )
    first = " ".join(causes[-1].split())[:_MESSAGE_CHARS] if causes else "no detail"
    return (
        f"rendezvous at {endpoint} failed ({first}); check the address and that every "
        "node was started."
    )


@contextlib.contextmanager
def _quiet_agent() -> Iterator[None]:
    """The agent logs its settings and each rank's failure; Kiln reports the failure itself
    as one line, so the agent's records are dropped while the job runs."""
    names = [name for name in logging.root.manager.loggerDict if name.startswith(_AGENT_LOGGERS)]
    loggers = [logging.getLogger(name) for name in names]
    saved = [logger.disabled for logger in loggers]
    for logger in loggers:
        logger.disabled = True
    try:
        yield
    finally:
        for logger, disabled in zip(loggers, saved, strict=True):
            logger.disabled = disabled
