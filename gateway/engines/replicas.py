"""Data-parallel engine replicas behind one gateway (`--data-parallel-size N`): each request goes to the replica the
router picks; each replica is an EngineClient with its own engine process, channels, KV cache and scheduler.

A replica that dies fails only its own in-flight requests that have streamed tokens and is restarted by its client
while the others serve; those with no token yet are sent, once, to another healthy replica (their client sees one
stream, as if nothing happened), and so are those of a replica that stops answering. The router sees only healthy
replicas. With one replica this is a thin layer over its client.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os

import msgspec

from engine.core.config import EngineConfig
from engine.core.defaults import usable_cores
from engine.core.request import EngineRequest
from engine.ipc.messages import AddRequest, EngineReady, LoadLora, LoraResult, UnloadLora
from gateway.engines.adapter_routing import AdapterAware
from gateway.engines.client import EngineClient, EngineUnavailableError
from gateway.engines.process import EngineProcess
from gateway.engines.routing import RoutingPolicy, make_router
from gateway.web.metrics import Metrics


def replica_config(config: EngineConfig, size: int) -> EngineConfig:
    """A replica's engine config: with several replicas on the CPU, the cores shared out unless the user set
    --num-threads (each replica's threads would otherwise fight the others' for every core)."""
    if size == 1 or config.num_threads is not None:
        return config
    return dataclasses.replace(config, num_threads=max(1, usable_cores() // size))


def replica_devices(config: EngineConfig, index: int, size: int) -> str | None:
    """CUDA_VISIBLE_DEVICES of replica `index`: its own tensor x pipeline GPUs, numbered from what this process sees."""
    if size == 1:
        return None
    per = config.tensor_parallel_size * config.pipeline_stages
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(size * per)]
    return ",".join(ids[index * per : (index + 1) * per])


class Replicas:
    """The engine clients and their router; the interface the endpoints use, whatever the number of replicas."""

    def __init__(
        self,
        config: EngineConfig,
        metrics: Metrics,
        hang_timeout: float = 60.0,
        size: int = 1,
        routing: RoutingPolicy = "cache-aware",
        unresponsive_timeout: float = 3.0,
    ):
        if size < 1:
            raise ValueError(f"--data-parallel-size must be 1 or more, got {size}")
        if size > 1 and config.external_stages:
            raise ValueError(
                "--external-stages has one rendezvous (MASTER_ADDR:MASTER_PORT) for one engine's ranks: "
                "run one server per replica's grid instead of --data-parallel-size"
            )
        if routing == "cache-aware" and not config.prefix_caching:
            routing = "least-loaded"  # no cache to be aware of
        self.routing = routing  # what routes, in effect
        self.router = make_router(routing if size > 1 else "round-robin", size, config.block_size)
        if config.lora_enabled and size > 1:  # adapter requests to a replica with their adapter resident
            self.router = AdapterAware(self.router, size, config.max_loras)
        on_cache = self.router.cache_events if size > 1 and routing == "cache-aware" else None
        each = replica_config(config, size)
        self.clients = [
            EngineClient(
                each,
                metrics,
                hang_timeout,
                i,
                on_cache,
                replica_devices(config, i, size),
                unresponsive_timeout,
                self._reroute,
            )
            for i in range(size)
        ]
        self.metrics = metrics
        for c in self.clients:
            metrics.add_replica(c.index, lambda c=c: c.healthy)
        self.where: dict[str, EngineClient] = {}  # request id -> the replica serving it
        self.grammars: dict[str, tuple[str, set[EngineProcess]]] = {}  # id -> grammar, engines it was sent to
        self.constrained: dict[str, str] = {}  # request id -> its grammar, to send along should the request move
        self.moved: set[str] = set()  # requests sent to a second replica: a second loss fails them
        self._moving: set[asyncio.Task] = set()  # re-submissions under way

    def launch(self) -> None:
        """Spawn every replica's first engine now (no event loop needed); start() adopts them."""
        try:
            for c in self.clients:
                c.launch()
        except BaseException:
            self.discard()
            raise

    def discard(self) -> None:
        """Kill the engines launched but never adopted (the server failed before it started)."""
        for c in self.clients:
            c.discard()

    async def start(self, timeout: float = 300.0) -> None:
        """Start every replica; if any cannot load the model, stop the others and raise its error."""
        results = await asyncio.gather(*(c.start(timeout) for c in self.clients), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await self.stop()
            raise failed[0]

    async def stop(self, timeout: float = 10.0) -> None:
        await asyncio.gather(*(c.stop(timeout) for c in self.clients))

    @property
    def healthy(self) -> bool:
        """Some replica can take requests."""
        return any(c.healthy for c in self.clients)

    @property
    def ready(self) -> EngineReady | None:
        """A healthy replica's description (the replicas run the same model under the same limits)."""
        return next((c.ready for c in self.clients if c.healthy), None)

    async def load_lora(self, name: str, path: str) -> LoraResult:
        """Load an adapter into every replica (each must serve any request); where one refuses it or cannot be
        reached, none keeps it."""
        updates = (c.update_lora(LoadLora(0, name, path)) for c in self.clients)
        results = await asyncio.gather(*updates, return_exceptions=True)
        loaded = [c for c, r in zip(self.clients, results) if isinstance(r, LoraResult) and r.error is None]
        if len(loaded) < len(self.clients):
            for c in loaded:  # a replica restarted meanwhile must not get it again
                c.loras.pop(name, None)
            await asyncio.gather(*(c.update_lora(UnloadLora(0, name)) for c in loaded), return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r
        return next((r for r in results if r.error is not None), results[0])

    async def unload_lora(self, name: str) -> LoraResult:
        for c in self.clients:  # whatever the answer: an engine restarted from now on does not get it again
            c.loras.pop(name, None)
        self.router.unloaded(name)
        results = await asyncio.gather(*(c.update_lora(UnloadLora(0, name)) for c in self.clients))
        return next((r for r in results if r.error is not None), results[0])

    async def add(self, request: EngineRequest, queue: asyncio.Queue, grammar_id: str | None = None) -> None:
        """Route the request to a replica and submit it there; its deltas (or an exception) arrive in `queue`."""
        # Where no replica answers but some still serve, a stall is likelier than a death: the request waits there
        # (until it answers, or the hang watchdog restarts it) rather than fail at once.
        candidates = [c for c in self.clients if c.healthy] or [c for c in self.clients if c.serving]
        if not candidates:
            raise EngineUnavailableError("the engine is not available")
        request_id, prompt, salt = request.request_id, request.prompt_token_ids, request.options.cache_salt
        lora = request.options.lora
        client, reason = self.router.route(request_id, candidates, prompt, salt, lora)
        self.where[request_id] = client
        if grammar_id is not None:
            self.constrained[request_id] = self.grammars[grammar_id][0]
        try:
            try:
                await self._submit(client, request, queue, grammar_id)
            except EngineUnavailableError:
                if self.where.get(request_id) is not client:  # its replica's death, seen meanwhile, moved it
                    self.metrics.routed.labels(str(client.index), reason).inc()
                    return
                # It died or stopped draining its ring between the choice and the send: another replica, once.
                others = [c for c in self.clients if c.healthy and c is not client]
                if not others:
                    raise
                self.router.done(request_id)
                why = "unresponsive" if client.engine is not None and client.engine.alive else "exited"
                self.metrics.rerouted.labels(str(client.index), why).inc()
                client, reason = self.router.route(request_id, others, prompt, salt, lora)
                self.where[request_id] = client
                self.moved.add(request_id)
                await self._submit(client, request, queue, grammar_id)
        except BaseException:
            del self.where[request_id]
            self.router.done(request_id)
            self._forget(request_id)
            raise
        self.metrics.routed.labels(str(client.index), reason).inc()

    async def _submit(
        self, client: EngineClient, request: EngineRequest, queue: asyncio.Queue, grammar_id: str | None
    ) -> None:
        if grammar_id is not None:
            await self._send_grammar(client, grammar_id)
        await client.add(request, queue, grammar_id)

    def _reroute(self, lost_on: EngineClient, msg: AddRequest, queue: asyncio.Queue, why: str) -> bool:
        """`lost_on` exited or stopped answering before `msg`'s request got a token: send it to another healthy
        replica, unless it was moved once already or there is none. True if it goes elsewhere."""
        request = msg.request
        request_id = request.request_id
        others = [c for c in self.clients if c.healthy and c is not lost_on]
        if request_id in self.moved or not others or self.where.get(request_id) is not lost_on:
            return False
        self.router.done(request_id)
        options = request.options
        client, reason = self.router.route(
            request_id, others, request.prompt_token_ids, options.cache_salt, options.lora
        )
        self.where[request_id] = client
        self.moved.add(request_id)
        self.metrics.rerouted.labels(str(lost_on.index), why).inc()
        self.metrics.routed.labels(str(client.index), reason).inc()
        task = asyncio.get_running_loop().create_task(self._resubmit(client, msg, queue))
        self._moving.add(task)
        task.add_done_callback(self._moving.discard)
        return True

    async def _resubmit(self, client: EngineClient, msg: AddRequest, queue: asyncio.Queue) -> None:
        request_id = msg.request.request_id
        if self.where.get(request_id) is not client:
            return  # aborted before it could be sent
        grammar = self.constrained.get(request_id)
        if grammar is not None:
            # Under an id of its own: the engine may hold the first id still, with its own requests waiting on it.
            msg = msgspec.structs.replace(msg, grammar_id=f"{msg.grammar_id}/{request_id}")
        try:
            if grammar is not None:
                await client.add_grammar(msg.grammar_id, grammar)
            try:
                await client.add(msg.request, queue, msg.grammar_id)
            finally:
                if grammar is not None:
                    client.release_grammar(msg.grammar_id)
        except EngineUnavailableError as e:
            queue.put_nowait((request_id, e))
            return
        if self.where.get(request_id) is not client:
            client.send_abort(request_id)  # aborted while it was being sent: an Abort that overtook it was lost

    async def add_grammar(self, grammar_id: str, grammar: str) -> None:
        """Keep a grammar for the requests that name it; each replica gets it once, with the first of them it serves."""
        if not any(c.serving for c in self.clients):
            raise EngineUnavailableError("the engine is not available")
        self.grammars[grammar_id] = (grammar, set())

    async def _send_grammar(self, client: EngineClient, grammar_id: str) -> None:
        grammar, sent_to = self.grammars[grammar_id]
        if client.engine not in sent_to:  # a restarted replica is a new engine: it needs the grammar again
            await client.add_grammar(grammar_id, grammar)
            sent_to.add(client.engine)

    def release_grammar(self, grammar_id: str) -> None:
        """No further request names the grammar: the engines that got it may drop it."""
        _, sent_to = self.grammars.pop(grammar_id, (None, ()))
        for client in self.clients:
            if client.engine in sent_to:
                client.release_grammar(grammar_id)

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it runs; frees its KV blocks at that engine's next iteration."""
        client = self.where.pop(request_id, None)
        if client is not None:
            client.abort(request_id)
            self.router.done(request_id)
            self._forget(request_id)

    def release(self, request_id: str) -> None:
        """Forget a finished request."""
        client = self.where.pop(request_id, None)
        if client is not None:
            client.release(request_id)
            self.router.done(request_id)
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        self.constrained.pop(request_id, None)
        self.moved.discard(request_id)
