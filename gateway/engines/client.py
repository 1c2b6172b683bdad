"""The gateway's side of one engine replica: submit requests, route token deltas back, keep an engine running.

A supervisor task watches the engine process. When it dies (crash, OOM kill, kill -9) its in-flight
requests that have had no token yet go to `on_lost` (another replica), the others fail at once with
EngineUnavailableError; the dead engine's channels are unlinked, and a new engine is started on fresh
ones; `healthy` is False until it is ready. A process that sends not even a heartbeat for
`unresponsive_timeout` seconds (stopped, swapped out, frozen) is out of routing until it answers again,
and its requests with no token yet go to `on_lost` too. An engine whose step loop sends nothing for
`hang_timeout` seconds (it reports at least once a second, and after every step) is killed and replaced.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable

from engine.core.config import EngineConfig
from engine.core.lora_pool import parse_lora
from engine.core.request import EngineRequest
from engine.core.sampling_params import InvalidRequestError
from engine.ipc.messages import (
    Abort,
    AddGrammar,
    AddRequest,
    CacheEvents,
    EngineReady,
    EngineStats,
    Heartbeat,
    LoadLora,
    LoraResult,
    PromptLogprobsPart,
    ReleaseGrammar,
    RequestError,
    StepDeltas,
    TokenDelta,
    UnloadLora,
)
from gateway.engines.process import EngineProcess
from gateway.web import errors
from gateway.web.metrics import Metrics

log = logging.getLogger("orcinus.engine_client")

SEND_TIMEOUT = 5.0  # seconds a full inbound ring may hold up a request before it fails with 503
LORA_TIMEOUT = 120.0  # seconds an adapter's load or unload may take before it fails with 503
RESTART_BACKOFF = (0.5, 30.0)  # first and longest wait before restarting an engine that died


class EngineUnavailableError(RuntimeError):
    """The engine process is not running, not ready, or stopped answering."""


def _log_crash(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.critical("engine supervision stopped", exc_info=task.exception())


class _Route:
    """Where a request's deltas go, and its tokens so far (prompt and output): its share of the replica's load."""

    __slots__ = ("num_tokens", "queue", "request", "started")

    def __init__(self, queue: asyncio.Queue, request: AddRequest):
        self.queue = queue
        self.request = request  # as sent: while nothing of it has come back, it can be sent elsewhere instead
        self.num_tokens = len(request.request.prompt_token_ids)
        self.started = False  # some of its output reached its queue: it can no longer move


# Offered a request whose replica exited ("exited") or stopped answering ("unresponsive") before its first token:
# True if another replica took it.
OnLost = Callable[["EngineClient", AddRequest, asyncio.Queue, str], bool]


class EngineClient:
    """Owns replica `index`'s current EngineProcess; one asyncio queue per request receives its deltas.

    `on_cache` (cache-aware routing) gets the engine's CacheEvents, and None whenever a new engine starts empty;
    `on_lost` is offered the requests the replica can no longer serve before their first token."""

    def __init__(
        self,
        config: EngineConfig,
        metrics: Metrics,
        hang_timeout: float = 60.0,
        index: int = 0,
        on_cache: Callable[[int, CacheEvents | None], None] | None = None,
        devices: str | None = None,
        unresponsive_timeout: float = 3.0,
        on_lost: OnLost | None = None,
    ):
        self.config = config
        self.metrics = metrics
        self.hang_timeout = hang_timeout
        self.unresponsive_timeout = unresponsive_timeout
        self.on_lost = on_lost
        self.index = index
        self.on_cache = on_cache
        self.devices = devices  # CUDA_VISIBLE_DEVICES for its engine; None: inherited
        self.engine: EngineProcess | None = None
        self.ready: EngineReady | None = None
        self.stats: EngineStats | None = None
        self.last_heard = 0.0  # the last frame of the step loop: its progress
        self.last_beat = 0.0  # the last frame of any kind, heartbeats included: the process answers
        self.unresponsive = False  # found not answering, and not answered since
        self.routes: dict[str, _Route] = {}
        self.load = 0  # tokens of the requests in flight: the sum of their routes' num_tokens
        self.start_timeout = 300.0
        self._ready_event = asyncio.Event()
        self._supervisor: asyncio.Task | None = None
        self._launched: EngineProcess | None = None  # spawned by launch(), before the event loop: start() adopts it
        # The LoRA adapters its engine serves (name -> path): --lora's, then those loaded and unloaded at run time.
        self.loras: dict[str, str] = dict(parse_lora(spec) for spec in config.lora)
        self._lora_ops: dict[int, asyncio.Future] = {}
        self._next_op = 1

    # ---------------------------------------------------------------- lifecycle

    def launch(self) -> None:
        """Spawn the first engine now, without an event loop, so it loads while the server gets ready; start() adopts
        it. One never adopted must be discarded."""
        self._launched = self._new_engine()
        self._launched.launch()

    def discard(self) -> None:
        """Kill and free an engine launched but never adopted by start()."""
        if self._launched is not None:
            self._launched.discard()
            self._launched = None

    def _new_engine(self, restart: bool = False) -> EngineProcess:
        config = self.config
        if restart:  # not --lora's adapters: some may be unloaded since, or loaded again from elsewhere (see _spawn)
            config = dataclasses.replace(config, lora=(), enable_lora=config.lora_enabled)
        return EngineProcess(config, self._on_frame, self.on_cache is not None, self.devices)

    async def start(self, timeout: float = 300.0) -> None:
        """Start the first engine. A model that cannot load at all is an error here, not retried."""
        self.start_timeout = timeout
        await self._spawn()
        self._supervisor = asyncio.create_task(self._supervise())
        self._supervisor.add_done_callback(_log_crash)

    async def stop(self, timeout: float = 10.0) -> None:
        """Stop supervising, ask the engine to exit (kill it after `timeout`), free its channels."""
        if self._supervisor is not None:
            self._supervisor.cancel()
            await asyncio.gather(self._supervisor, return_exceptions=True)
        if self.engine is not None:
            if self.ready is None:
                self.engine.kill()  # still loading (or already dead): nothing to wait for
            await self.engine.stop(timeout)
        self.ready = None
        self._fail_in_flight(EngineUnavailableError("the server is shutting down"))

    @property
    def serving(self) -> bool:
        """Up and not yet judged hung: it may take requests, which wait while it does not answer."""
        return (
            self.ready is not None
            and self.engine is not None
            and self.engine.alive
            and time.monotonic() - self.last_heard < self.hang_timeout
        )

    @property
    def healthy(self) -> bool:
        return self.serving and self.answering

    @property
    def answering(self) -> bool:
        """The engine process sent something, a heartbeat at least, within `unresponsive_timeout` (frames waiting
        unread count: then the gateway is the one behind)."""
        return time.monotonic() - self.last_beat < self.unresponsive_timeout or (
            self.engine is not None and self.engine.unread
        )

    async def _spawn(self) -> None:
        """Start an engine on fresh channels and wait until it is ready; clean up if it never is."""
        self.ready = self.stats = None
        self._ready_event = asyncio.Event()
        if self.on_cache is not None:
            self.on_cache(self.index, None)
        restart = self.engine is not None
        engine, self._launched = self._launched or self._new_engine(restart), None
        self.engine = engine
        await engine.start()
        exited = asyncio.ensure_future(engine.wait())
        ready = asyncio.ensure_future(self._ready_event.wait())
        try:
            await asyncio.wait({exited, ready}, timeout=self.start_timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ready.cancel()
            exited.cancel()
        if self.ready is None or not engine.alive:
            died = engine.proc.returncode is not None
            engine.kill()
            code = await engine.wait()
            await engine.close()
            self.ready = None
            if died:
                raise EngineUnavailableError(f"the engine process exited while loading the model (code {code})")
            raise EngineUnavailableError(f"the engine did not become ready in {self.start_timeout:.0f}s")
        self.last_heard = self.last_beat = time.monotonic()
        self.unresponsive = False
        if restart:  # the adapters served now, before any request that names one (the ring keeps order)
            for name, path in self.loras.items():
                await self._send(engine, LoadLora(0, name, path))

    async def _supervise(self) -> None:
        while True:
            engine = self.engine
            code = await self._wait_exit_or_hang(engine)
            self.ready = None
            self._lose_in_flight(EngineUnavailableError(f"the engine process exited (code {code})"))
            await engine.close()
            log.error(
                "engine process %s (replica %d) exited with code %s; starting a new one", engine.pid, self.index, code
            )
            self.metrics.engine_restarts.labels(str(self.index)).inc()
            backoff = RESTART_BACKOFF[0]
            while True:
                try:
                    await self._spawn()
                    log.info("engine process %s is ready", self.engine.pid)
                    break
                except EngineUnavailableError as e:
                    log.error("%s; retrying in %.1fs", e, backoff)
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, RESTART_BACKOFF[1])

    async def _wait_exit_or_hang(self, engine: EngineProcess) -> int:
        exited = asyncio.ensure_future(engine.wait())
        poll = min(1.0, self.unresponsive_timeout / 4)
        try:
            while True:
                done, _ = await asyncio.wait({exited}, timeout=poll)
                if done:
                    return exited.result()
                self._watch_answering(engine)
                silent = time.monotonic() - self.last_heard
                if silent > self.hang_timeout:
                    log.error("no word from engine process %s in %.0fs; killing it", engine.pid, silent)
                    engine.kill()
        finally:
            exited.cancel()

    def _watch_answering(self, engine: EngineProcess) -> None:
        """Out of routing while the process does not answer (`healthy` says so); its requests with no token yet are
        offered elsewhere, and aborted here should it wake. Those streaming wait for it, or for the hang watchdog."""
        if self.answering:
            if self.unresponsive:
                self.unresponsive = False
                log.warning("engine process %s (replica %d) answers again; back in routing", engine.pid, self.index)
            return
        if not self.unresponsive:
            self.unresponsive = True
            log.error(
                "engine process %s (replica %d) sent nothing in %.1fs; out of routing until it answers",
                engine.pid,
                self.index,
                time.monotonic() - self.last_beat,
            )
        if self.on_lost is None:
            return
        for request_id, route in list(self.routes.items()):
            if not route.started and self.on_lost(self, route.request, route.queue, "unresponsive"):
                self._drop(request_id)
                self._send_abort(engine, request_id)

    def _lose_in_flight(self, error: Exception) -> None:
        """The engine exited: each request with no token yet is offered elsewhere; the rest fail with `error`."""
        routes, self.routes, self.load = self.routes, {}, 0
        for request_id, route in routes.items():
            if route.started or self.on_lost is None or not self.on_lost(self, route.request, route.queue, "exited"):
                route.queue.put_nowait((request_id, error))

    def _fail_in_flight(self, error: Exception) -> None:
        routes, self.routes, self.load = self.routes, {}, 0
        for request_id, route in routes.items():
            route.queue.put_nowait((request_id, error))

    def _drop(self, request_id: str) -> _Route | None:
        route = self.routes.pop(request_id, None)
        if route is not None:
            self.load -= route.num_tokens
        return route

    # ---------------------------------------------------------------- requests

    async def add(self, request: EngineRequest, queue: asyncio.Queue, grammar_id: str | None = None) -> None:
        """Route the request's deltas (TokenDelta, or an exception) into `queue`, then submit it."""
        if not self.serving:
            raise EngineUnavailableError("the engine is not available")
        request_id = request.request_id
        msg = AddRequest(request, grammar_id)
        self.routes[request_id] = _Route(queue, msg)
        self.load += len(request.prompt_token_ids)
        try:
            await self._send(self.engine, msg)
        except BaseException:
            self._drop(request_id)
            raise

    async def add_grammar(self, grammar_id: str, grammar: str) -> None:
        """Send a grammar once for the requests that name it (each starts with its own copy of its matcher)."""
        if not self.serving:
            raise EngineUnavailableError("the engine is not available")
        await self._send(self.engine, AddGrammar(grammar_id, grammar))

    def release_grammar(self, grammar_id: str) -> None:
        """No further request names the grammar: the engine may drop it."""
        if self.engine is None or not self.engine.alive:
            return
        if not self.engine.try_send(ReleaseGrammar(grammar_id)):
            asyncio.get_running_loop().create_task(self._send_quietly(self.engine, ReleaseGrammar(grammar_id)))

    def abort(self, request_id: str) -> None:
        """Stop a request and forget its route; frees its KV blocks at the engine's next iteration."""
        if self._drop(request_id) is not None:
            self.send_abort(request_id)

    def send_abort(self, request_id: str) -> None:
        """Send an Abort whether or not the request is routed here (an engine ignores one of a request it lacks)."""
        if self.engine is not None and self.engine.alive:
            self._send_abort(self.engine, request_id)

    def _send_abort(self, engine: EngineProcess, request_id: str) -> None:
        # An abort that does not fit now is retried from a task rather than lost.
        if not engine.try_send(Abort(request_id)):
            asyncio.get_running_loop().create_task(self._send_quietly(engine, Abort(request_id)))

    def release(self, request_id: str) -> None:
        """Forget a finished request's route."""
        self._drop(request_id)

    async def update_lora(self, msg: LoadLora | UnloadLora) -> LoraResult:
        """Send a LoadLora or UnloadLora (its op_id set here) and wait for the engine's answer."""
        if not self.serving:
            raise EngineUnavailableError("the engine is not available")
        op_id, self._next_op = self._next_op, self._next_op + 1
        msg.op_id = op_id
        future = self._lora_ops[op_id] = asyncio.get_running_loop().create_future()
        try:
            await self._send(self.engine, msg)
            async with asyncio.timeout(LORA_TIMEOUT):
                result = await future
        except TimeoutError:
            raise EngineUnavailableError("the engine did not answer the adapter update in time") from None
        finally:
            self._lora_ops.pop(op_id, None)
        if result.error is None:
            if isinstance(msg, LoadLora):
                self.loras[msg.name] = msg.path
            else:
                self.loras.pop(msg.name, None)
        return result

    async def _send(self, engine: EngineProcess, msg) -> None:
        deadline = time.monotonic() + SEND_TIMEOUT
        while True:
            try:
                if engine.try_send(msg):
                    return
            except ProcessLookupError:
                raise EngineUnavailableError("the engine process exited") from None
            if time.monotonic() > deadline:
                raise EngineUnavailableError("the engine is not draining its queue")
            await asyncio.sleep(0.001)

    async def _send_quietly(self, engine: EngineProcess, msg: Abort | ReleaseGrammar) -> None:
        try:
            await self._send(engine, msg)
        except EngineUnavailableError:
            pass  # a dead engine holds nothing; a stuck one is the watchdog's business

    # ---------------------------------------------------------------- frames from the engine

    def _on_frame(self, msg) -> None:
        self.last_beat = now = time.monotonic()
        if isinstance(msg, Heartbeat):
            return  # from the engine's own thread: it shows the process answers, not that its step loop goes on
        self.last_heard = now
        if isinstance(msg, StepDeltas):
            for delta in msg.deltas:
                self._on_delta(delta)
            for request_id, token_id in zip(msg.request_ids, msg.token_ids):
                self._on_delta(TokenDelta(request_id, [token_id], None))
        elif isinstance(msg, PromptLogprobsPart):
            route = self.routes.get(msg.request_id)
            if route is not None:
                route.started = True  # its client gathers the parts: sent again from elsewhere, they would repeat
                route.queue.put_nowait((msg.request_id, msg))
        elif isinstance(msg, CacheEvents):
            if self.on_cache is not None:
                self.on_cache(self.index, msg)
        elif isinstance(msg, EngineStats):
            self.stats = msg
            self.metrics.observe_stats(msg, self.index)
        elif isinstance(msg, RequestError):
            route = self._drop(msg.request_id)
            if msg.internal:
                self.metrics.failed.inc()
            if route is not None:
                if msg.internal:
                    error = errors.internal_error(f"The engine failed this request: {msg.message}")
                elif msg.not_found:  # an adapter unloaded before the request could run under it
                    error = errors.not_found(msg.message, msg.param)
                else:
                    error = InvalidRequestError(msg.message, msg.param)
                route.queue.put_nowait((msg.request_id, error))
        elif isinstance(msg, LoraResult):
            future = self._lora_ops.get(msg.op_id)
            if future is not None and not future.done():
                future.set_result(msg)
        elif isinstance(msg, EngineReady):
            self.ready = msg
            self._ready_event.set()

    def _on_delta(self, msg: TokenDelta) -> None:
        route = self.routes.get(msg.request_id)
        if route is not None:
            route.started = True
            route.queue.put_nowait((msg.request_id, msg))
            route.num_tokens += len(msg.token_ids)
            self.load += len(msg.token_ids)
            if msg.finish_reason is not None:
                self._drop(msg.request_id)
