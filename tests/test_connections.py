"""Slow clients at the connection (gateway/web/connections.py), on uvicorn's protocol with a fake transport: the
request-head deadline, the cap on open connections and its two log lines, the write-stall deadline."""

from __future__ import annotations

import asyncio
import logging

from uvicorn.config import Config
from uvicorn.server import ServerState

from gateway.web.connections import default_max_connections, guarded_h11


class Transport(asyncio.Transport):
    def __init__(self):
        super().__init__()
        self.written, self.closed, self.aborted = b"", False, False

    def write(self, data) -> None:
        self.written += bytes(data)

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def get_extra_info(self, name, default=None):
        return {"peername": ("127.0.0.1", 5000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def app(scope, receive, send):
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})


def protocol_factory(max_connections=100, header_timeout=60.0, send_timeout=60.0):
    config, state = Config(app, log_config=None), ServerState()  # leave logging as pytest set it
    cls = guarded_h11(max_connections, header_timeout, send_timeout)
    return state, lambda: cls(config=config, server_state=state, app_state={}, _loop=asyncio.get_running_loop())


def connect(factory):
    p, t = factory(), Transport()
    p.connection_made(t)
    return p, t


def test_a_head_that_does_not_arrive_in_time_gets_a_408_and_the_connection_closes():
    async def run():
        _, factory = protocol_factory(header_timeout=0.05)
        slow, slow_t = connect(factory)
        slow.data_received(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # a slowloris head, never finished
        fast, fast_t = connect(factory)
        fast.data_received(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0.3)
        return slow_t, fast_t

    slow_t, fast_t = asyncio.run(run())
    assert slow_t.closed and slow_t.written.startswith(b"HTTP/1.1 408 ") and b'"request_timeout"' in slow_t.written
    # The fast one was answered; then, idle, it too is closed at the deadline, without a word.
    assert fast_t.written.startswith(b"HTTP/1.1 200 ") and fast_t.written.count(b"HTTP/1.1") == 1 and fast_t.closed


def test_past_the_cap_a_connection_gets_a_503_and_two_lines_are_logged_whatever_the_refusals(caplog):
    async def run():
        state, factory = protocol_factory(max_connections=3)
        kept = [connect(factory) for _ in range(3)]
        refused = [connect(factory)[1] for _ in range(50)]
        kept[0][0].connection_lost(None)
        after = connect(factory)[1]
        return state, refused, after

    with caplog.at_level(logging.WARNING, logger="uvicorn.error"):
        state, refused, after = asyncio.run(run())
    assert all(
        t.closed and t.written.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in t.written for t in refused
    )
    assert not after.closed and len(state.connections) == 3
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "3 connections are open" in lines[0] and "50 were refused" in lines[1], lines


def test_a_client_that_reads_nothing_for_the_send_timeout_is_dropped():
    async def run():
        _, factory = protocol_factory(send_timeout=0.05)
        stuck, stuck_t = connect(factory)
        stuck.pause_writing()  # the socket's buffers are full: the client is not reading
        slow, slow_t = connect(factory)
        slow.pause_writing()
        slow.resume_writing()  # it read in time (at once: no timing to race)
        await asyncio.sleep(0.3)
        return stuck_t, slow_t

    stuck_t, slow_t = asyncio.run(run())
    assert stuck_t.aborted and not slow_t.aborted


def test_the_default_cap_leaves_room_under_the_open_files_limit():
    assert default_max_connections(1024) == 768 and default_max_connections(1 << 20) == 4096
    assert default_max_connections(100) == 16
