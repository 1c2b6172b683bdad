"""Data-parallel engine replicas behind one gateway (`--data-parallel-size N`): each request goes to the replica the
router picks; each replica is an EngineClient with its own engine process, channels, KV cache and scheduler.

A replica that dies fails only its own in-flight requests and is restarted by its client while the others serve;
the router sees only healthy replicas. With one replica this is a thin layer over its client.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os

from engine.core.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.ipc.messages import EngineReady
from gateway.config import GatewayConfig
from gateway.engine_client import EngineClient, EngineUnavailableError
from gateway.engine_process import EngineProcess
from gateway.metrics import Metrics
from gateway.routing import RoutingPolicy, make_router


def replica_config(config: EngineConfig, size: int) -> EngineConfig:
    """A replica's engine config: with several replicas on the CPU, the cores shared out unless the user set
    --num-threads (each replica's threads would otherwise fight the others' for every core)."""
    if size == 1 or config.num_threads is not None:
        return config
    return dataclasses.replace(config, num_threads=max(1, (os.cpu_count() or 1) // size))


def replica_devices(config: EngineConfig, index: int, size: int) -> str | None:
    """CUDA_VISIBLE_DEVICES of replica `index`: its own tensor x pipeline GPUs, numbered from what this process sees."""
    if size == 1:
        return None
    per = config.tensor_parallel_size * config.pipeline_stages
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(size * per)]
    return ",".join(ids[index * per:(index + 1) * per])


class Replicas:
    """The engine clients and their router; the interface the endpoints use, whatever the number of replicas."""

    def __init__(self, config: EngineConfig, metrics: Metrics, hang_timeout: float = 60.0, size: int = 1,
                 routing: RoutingPolicy = "cache-aware"):
        if size < 1:
            raise ValueError(f"--data-parallel-size must be 1 or more, got {size}")
        if size > 1 and config.external_stages:
            raise ValueError("--external-stages has one rendezvous (MASTER_ADDR:MASTER_PORT) for one engine's ranks: "
                             "run one server per replica's grid instead of --data-parallel-size")
        if routing == "cache-aware" and not config.prefix_caching:
            routing = "least-loaded"  # no cache to be aware of
        self.routing = routing  # what routes, in effect
        self.router = make_router(routing if size > 1 else "round-robin", size, config.block_size)
        on_cache = self.router.cache_events if size > 1 and routing == "cache-aware" else None
        each = replica_config(config, size)
        self.clients = [EngineClient(each, metrics, hang_timeout, i, on_cache, replica_devices(config, i, size))
                        for i in range(size)]
        self.metrics = metrics
        for i in range(size):
            metrics.add_replica(i)
        self.where: dict[str, EngineClient] = {}  # request id -> the replica serving it
        self.grammars: dict[str, tuple[str, set[EngineProcess]]] = {}  # id -> grammar, engines it was sent to

    @classmethod
    def for_server(cls, config: GatewayConfig) -> Replicas:
        """A server's replicas, with metrics of their own (raises ValueError for a combination they cannot run)."""
        return cls(config.engine, Metrics(), config.engine_hang_timeout, config.data_parallel_size, config.routing)

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

    async def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                  queue: asyncio.Queue, cache_salt: bytes = b"", grammar_id: str | None = None,
                  priority: int = 0) -> None:
        """Route `request_id` to a replica and submit it there; its deltas (or an exception) arrive in `queue`."""
        healthy = [c for c in self.clients if c.healthy]
        if not healthy:
            raise EngineUnavailableError("the engine is not available")
        client, reason = self.router.route(request_id, healthy, prompt_token_ids, cache_salt)
        self.where[request_id] = client
        try:
            if grammar_id is not None:
                await self._send_grammar(client, grammar_id)
            await client.add(request_id, prompt_token_ids, params, queue, cache_salt, grammar_id, priority)
        except BaseException:
            del self.where[request_id]
            self.router.done(request_id)
            raise
        self.metrics.routed.labels(str(client.index), reason).inc()

    async def add_grammar(self, grammar_id: str, grammar: str) -> None:
        """Keep a grammar for the requests that name it; each replica gets it once, with the first of them it serves."""
        if not self.healthy:
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

    def release(self, request_id: str) -> None:
        """Forget a finished request."""
        client = self.where.pop(request_id, None)
        if client is not None:
            client.release(request_id)
            self.router.done(request_id)
