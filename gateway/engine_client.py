"""The gateway's side of the engine process: start it, feed it requests, route its token deltas back."""

from __future__ import annotations

import asyncio
import logging
import sys
import time

import msgspec

from engine.channel import Channel
from engine.config import EngineConfig
from engine.messages import (
    Abort, AddRequest, EngineReady, EngineStats, FromEngine, RequestError, Shutdown, TokenDelta, ToEngine,
)
from engine.sampling_params import InvalidRequestError, SamplingParams
from engine.worker import WorkerSpec
from gateway.metrics import Metrics

log = logging.getLogger("orcinus.engine_client")

SEND_TIMEOUT = 5.0  # seconds a full inbound ring may hold up a request before it fails with 503
STATS_STALE_AFTER = 30.0  # the engine reports at least every second when idle; a long prefill may delay it


class EngineUnavailableError(RuntimeError):
    """The engine process is not running, not ready, or stopped answering."""


class EngineClient:
    """Owns the engine process and both channels; one asyncio queue per request receives its deltas."""

    def __init__(self, config: EngineConfig, metrics: Metrics):
        self.config = config
        self.metrics = metrics
        self.ready: EngineReady | None = None
        self.stats: EngineStats | None = None
        self.last_heard = 0.0
        self.routes: dict[str, asyncio.Queue] = {}
        self.proc: asyncio.subprocess.Process | None = None
        self._tasks: list[asyncio.Task] = []
        self._ready_event = asyncio.Event()
        self.to_engine = self.from_engine = None
        self._stopping = False

    # ---------------------------------------------------------------- lifecycle

    async def start(self, timeout: float = 300.0) -> None:
        self.to_engine = Channel.create(ToEngine)
        self.from_engine = Channel.create(FromEngine)
        spec = WorkerSpec(self.config, self.to_engine.handle(), self.from_engine.handle())
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "engine.worker", msgspec.json.encode(spec).decode()
        )
        self._tasks = [asyncio.create_task(self._read_loop()), asyncio.create_task(self._watch_process())]
        try:
            await asyncio.wait_for(self._ready_event.wait(), timeout)
        except asyncio.TimeoutError:
            raise EngineUnavailableError(f"the engine did not become ready in {timeout:.0f}s") from None
        if self.ready is None:
            raise EngineUnavailableError("the engine process exited while loading the model")

    async def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        if self.proc is not None and self.proc.returncode is None:
            self.to_engine.try_send(Shutdown())
            try:
                await asyncio.wait_for(self.proc.wait(), timeout)
            except asyncio.TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        for t in self._tasks:
            t.cancel()
        for ch in (self.to_engine, self.from_engine):
            if ch is not None:
                ch.close()
                ch.unlink()

    @property
    def healthy(self) -> bool:
        return (
            self.ready is not None
            and self.proc is not None
            and self.proc.returncode is None
            and time.monotonic() - self.last_heard < STATS_STALE_AFTER
        )

    # ---------------------------------------------------------------- requests

    async def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                  queue: asyncio.Queue) -> None:
        """Route `request_id`'s deltas (TokenDelta, or an exception) into `queue`, then submit it."""
        if not self.healthy:
            raise EngineUnavailableError("the engine is not available")
        self.routes[request_id] = queue
        try:
            await self._send(AddRequest(request_id, prompt_token_ids, params))
        except BaseException:
            self.routes.pop(request_id, None)
            raise

    def abort(self, request_id: str) -> None:
        """Stop a request and forget its route; frees its KV blocks at the engine's next iteration."""
        if self.routes.pop(request_id, None) is not None and self.proc and self.proc.returncode is None:
            # An abort that does not fit now is retried from a task rather than lost.
            if not self.to_engine.try_send(Abort(request_id)):
                asyncio.get_running_loop().create_task(self._send(Abort(request_id)))

    def release(self, request_id: str) -> None:
        """Forget a finished request's route."""
        self.routes.pop(request_id, None)

    async def _send(self, msg) -> None:
        deadline = time.monotonic() + SEND_TIMEOUT
        while not self.to_engine.try_send(msg):
            if time.monotonic() > deadline:
                raise EngineUnavailableError("the engine is not draining its queue")
            await asyncio.sleep(0.001)

    # ---------------------------------------------------------------- background tasks

    async def _read_loop(self) -> None:
        while True:
            for msg in await self.from_engine.recv_async():
                self.last_heard = time.monotonic()
                if isinstance(msg, TokenDelta):
                    queue = self.routes.get(msg.request_id)
                    if queue is not None:
                        queue.put_nowait((msg.request_id, msg))
                        if msg.finish_reason is not None:
                            self.routes.pop(msg.request_id, None)
                elif isinstance(msg, EngineStats):
                    self.stats = msg
                    self.metrics.observe_stats(msg)
                elif isinstance(msg, RequestError):
                    queue = self.routes.pop(msg.request_id, None)
                    if queue is not None:
                        queue.put_nowait((msg.request_id, InvalidRequestError(msg.message, msg.param)))
                elif isinstance(msg, EngineReady):
                    self.ready = msg
                    self._ready_event.set()

    async def _watch_process(self) -> None:
        code = await self.proc.wait()
        if not self._stopping:
            log.error("engine process exited with code %s", code)
        self._ready_event.set()
        self.ready = None
        error = EngineUnavailableError(f"the engine process exited (code {code})")
        for request_id, queue in list(self.routes.items()):
            queue.put_nowait((request_id, error))
        self.routes.clear()
