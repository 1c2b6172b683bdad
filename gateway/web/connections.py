"""Slow and idle clients, at the connection: uvicorn's h11 protocol with three deadlines and a cap.

- A request's head (request line and headers) must arrive within `header_timeout` seconds (up to a quarter
  more, spread at random) of the connection opening or of the previous response ending, or the connection is closed (with a 408 if part of a head came): a
  slowloris client that sends a header byte now and then holds nothing for long.
- A connection whose client reads nothing for `send_timeout` seconds while a response waits to be written (the
  socket's buffers are full) is dropped; the app sees a disconnect, so a stream's requests are aborted and what
  was not sent is freed.
- Past `max_connections` open connections a new one gets a 503 and is closed at once, well before the process
  runs out of file descriptors; one line is logged when the cap is reached and one when it is left.
"""

from __future__ import annotations

import asyncio
import logging
import random
import resource
import socket

import msgspec
from uvicorn.protocols.http.h11_impl import H11Protocol

from gateway.web.errors import ErrorDetail, ErrorResponse

log = logging.getLogger("uvicorn.error")

FD_TARGET = 65536  # the soft limit on open files is raised toward this (within the hard limit), as vLLM does
FD_RESERVE = 256  # descriptors kept for everything but client connections (engine channels, logs, libraries)
DEFAULT_MAX_CONNECTIONS = 4096
HEAD_DEADLINE_SPREAD = 0.25  # each connection's head deadline falls at random in [timeout, 1.25 x timeout]


def _response(status: str, code: str, message: str, extra: str = "") -> bytes:
    body = msgspec.json.encode(
        ErrorResponse(
            error=ErrorDetail(
                message=message,
                type="invalid_request_error" if status.startswith("4") else "service_unavailable_error",
                param=None,
                code=code,
            )
        )
    )
    head = (
        f"HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n{extra}"
        "connection: close\r\n\r\n"
    )
    return head.encode() + body


HEAD_TIMED_OUT = _response("408 Request Timeout", "request_timeout", "The request's headers took too long to arrive.")
AT_CAPACITY = _response(
    "503 Service Unavailable",
    "too_many_connections",
    "The server has too many open connections; retry shortly.",
    "retry-after: 1\r\n",
)


def bind(host: str, port: int) -> list[socket.socket]:
    """Sockets bound to every address of host:port, not yet listening: a port in use fails the start before the model
    loads, and until the engine is ready a client is refused at once rather than queued. Raises OSError."""
    socks = []
    try:
        for family, kind, proto, _, address in socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        ):
            sock = socket.socket(family, kind, proto)
            socks.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # as asyncio's create_server: an IPv6 address does not take IPv4 too
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(address)
    except OSError:
        for sock in socks:
            sock.close()
        raise
    return socks


def raise_fd_limit() -> int:
    """Raise this process's soft limit on open files toward FD_TARGET; returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = FD_TARGET if hard == resource.RLIM_INFINITY else min(FD_TARGET, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def default_max_connections(fd_limit: int) -> int:
    return max(16, min(DEFAULT_MAX_CONNECTIONS, fd_limit - FD_RESERVE))


class _Cap:
    """Counts refusals; logs the start and the end of each stretch at the cap, never one line per refusal."""

    def __init__(self, limit: int):
        self.limit = limit
        self.refused = 0

    def refuse(self) -> None:
        if self.refused == 0:
            log.warning(
                "%d connections are open, the most --max-connections allows: new connections get 503 until some close",
                self.limit,
            )
        self.refused += 1

    def accepted(self) -> None:
        if self.refused:
            log.warning("accepting connections again; %d were refused at the cap", self.refused)
            self.refused = 0


def guarded_h11(max_connections: int, header_timeout: float, send_timeout: float) -> type[H11Protocol]:
    """uvicorn's `http` protocol class with the deadlines and the cap (one cap per server)."""
    cap = _Cap(max_connections)

    class GuardedH11Protocol(H11Protocol):
        _refused = False
        _head_timer: asyncio.TimerHandle | None = None
        _stall_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:
            if len(self.connections) >= cap.limit:
                self._refused = True
                self.transport = transport
                cap.refuse()
                transport.write(AT_CAPACITY)
                transport.close()
                return
            cap.accepted()
            super().connection_made(transport)
            self._await_head()

        def data_received(self, data: bytes) -> None:
            if not self._refused:
                super().data_received(data)

        def connection_lost(self, exc: Exception | None) -> None:
            for timer in (self._head_timer, self._stall_timer):
                if timer is not None:
                    timer.cancel()
            if self._refused:
                return
            super().connection_lost(exc)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._await_head()

        def _await_head(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            # Up to a quarter later, at random: a thousand connections opened at once are not all closed (and
            # reopened) in one turn of the event loop, which would hold up everyone else's responses.
            deadline = header_timeout * random.uniform(1.0, 1.0 + HEAD_DEADLINE_SPREAD)
            self._head_timer = self.loop.call_later(deadline, self._head_deadline, self.cycle)

        def _head_deadline(self, cycle) -> None:
            # A new request head makes a new cycle: the same one, answered (or none), means no head came in time.
            waiting = self.cycle is cycle and (cycle is None or cycle.response_complete)
            if waiting and not self.transport.is_closing():
                if self.conn.trailing_data[0]:  # part of a head came: say why; an idle connection just closes
                    self.transport.write(HEAD_TIMED_OUT)
                self.transport.close()

        def pause_writing(self) -> None:
            super().pause_writing()
            if self._stall_timer is None:
                self._stall_timer = self.loop.call_later(send_timeout, self._stalled)

        def resume_writing(self) -> None:
            super().resume_writing()
            if self._stall_timer is not None:
                self._stall_timer.cancel()
                self._stall_timer = None

        def _stalled(self) -> None:
            self._stall_timer = None
            self.transport.abort()  # the client reads nothing: what waits to be written is dropped

    return GuardedH11Protocol
