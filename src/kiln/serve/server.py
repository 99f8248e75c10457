"""The listening socket and the HTTP server around the app.

The socket is bound first, before any model is loaded, so a port out of range, a port in use or
a host that does not resolve is one line at once rather than an error after a long load; the
bound socket is then handed to uvicorn, which is how `--port 0` can say the port it got.

uvicorn closes a keep-alive connection that stays idle, but waits forever for a request head
that never ends; the protocol here closes a connection whose head is not complete within that
same keep-alive timeout, so a client that stalls mid-headers cannot hold a connection forever.
(A body that stalls is the app's to answer: 408, see app.py.)
"""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import Callable
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kiln.errors import KilnError


def bind(host: str, port: int, flag: str = "--port") -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free port); KilnError naming `flag`
    when the port is out of range or taken, or the host does not resolve to this machine."""
    family, kind, proto, address = resolve(host, port, flag)
    sock = socket.socket(family, kind, proto)
    # As uvicorn does: a restart can rebind at once. It does not share a port in use (Linux).
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise KilnError(_bind_problem(host, port, exc, flag)) from None
    sock.set_inheritable(True)
    return sock


def resolve(host: str, port: int, flag: str = "--port") -> tuple[int, int, int, Any]:
    """The address host:port binds (family, type, proto, sockaddr): one, IPv4 first, as
    clients asking for "localhost" mostly try 127.0.0.1. KilnError naming `flag` for a port
    out of range, and for a host that does not resolve."""
    if not 0 <= port <= 65535:
        raise KilnError(f"{flag} {port}: use a port from 1 to 65535, or 0 for any free port.")
    try:
        infos = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE | socket.AI_ADDRCONFIG
        )
    except (OSError, UnicodeError, ValueError) as exc:
        reason = getattr(exc, "strerror", None) or str(exc)
        raise KilnError(
            f"--host {host}: cannot resolve it ({reason}); give an address of this machine, "
            "e.g. 127.0.0.1, or 0.0.0.0 for every interface."
        ) from None
    ipv4 = [info for info in infos if info[0] == socket.AF_INET]
    family, kind, proto, _, address = (ipv4 or infos)[0]
    return family, kind, proto, address


def _bind_problem(host: str, port: int, exc: OSError, flag: str) -> str:
    if exc.errno == errno.EADDRINUSE:
        return (
            f"{flag} {port}: the port is in use on {host}; stop what holds it, pick another "
            f"port, or give {flag} 0 for any free one."
        )
    if exc.errno == errno.EACCES:
        return f"{flag} {port}: binding it needs privileges (ports below 1024); use 1024 or above."
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"--host {host}: not an address of this machine; use 127.0.0.1 or 0.0.0.0."
    return f"cannot listen on {host}:{port}: {exc.strerror or exc}."


def url(host: str, port: int) -> str:
    """http://host:port, with an IPv6 address in brackets."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _HeadDeadline:
    """Closes a connection whose request head is not complete `timeout_keep_alive` seconds
    after the connection opened or the last answer was sent; mixed into uvicorn's protocols,
    each saying in `_waiting_for_head` whether no request has begun since."""

    _deadline: asyncio.TimerHandle | None = None
    loop: asyncio.AbstractEventLoop
    transport: Any
    timeout_keep_alive: float

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # type: ignore[misc]
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        super().connection_lost(exc)  # type: ignore[misc]

    def _arm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(self.timeout_keep_alive, self._head_overdue)

    def _head_overdue(self) -> None:
        if self.transport.is_closing():
            return
        if self._waiting_for_head():  # no complete request head since armed
            self.transport.close()
        else:  # a request in progress; look again later (a finished answer re-arms anyway)
            self._arm()

    def _waiting_for_head(self) -> bool:
        raise NotImplementedError


class _HeadDeadlineH11(_HeadDeadline, H11Protocol):
    """uvicorn's h11 protocol (pure Python) with the head deadline."""

    def _waiting_for_head(self) -> bool:
        return self.conn.their_state is h11.IDLE


def _protocol() -> type:
    """uvicorn's httptools protocol with the head deadline where httptools is installed, else
    its h11 one. httptools parses in C: a bare answer's round trip is shorter than with h11's,
    and shorter still with uvloop, which uvicorn then picks by itself ("Serving" in
    docs/contributing/engine-notes.md)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return _HeadDeadlineH11

    class _HeadDeadlineHttpTools(_HeadDeadline, HttpToolsProtocol):
        """uvicorn's httptools protocol with the head deadline: a head counts once parsed
        whole (`on_headers_complete`), and a request runs until its answer is complete."""

        _heads = _armed_at = 0

        def on_headers_complete(self) -> None:
            self._heads += 1
            super().on_headers_complete()

        def _arm(self) -> None:
            self._armed_at = self._heads
            super()._arm()

        def _waiting_for_head(self) -> bool:
            idle = self.cycle is None or self.cycle.response_complete
            return idle and not self.pipeline and self._heads == self._armed_at

    return _HeadDeadlineHttpTools


class _Server(uvicorn.Server):
    """uvicorn's server, calling `on_ready` once it accepts requests."""

    def __init__(self, config: uvicorn.Config, on_ready: Callable[[], None] | None) -> None:
        super().__init__(config)
        self._on_ready = on_ready

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.started and self._on_ready is not None:
            self._on_ready()


def http_server(
    app: Any, *, timeout_keep_alive: int = 5, on_ready: Callable[[], None] | None = None
) -> uvicorn.Server:
    """A uvicorn server for `app`; run it with `.run(sockets=[bind(host, port)])`, stop it
    with `.should_exit = True` (or SIGINT/SIGTERM, from the main thread)."""
    config = uvicorn.Config(
        app,
        http=_protocol(),
        timeout_keep_alive=timeout_keep_alive,
        log_level="warning",
        access_log=False,  # one line per request costs real time at high request rates
    )
    return _Server(config, on_ready)
