"""Which engine replica serves a request (`--data-parallel-size N`): round-robin, least-loaded, or cache-aware.

A replica's load is the tokens of the requests the gateway has in flight on it (prompts plus outputs so far): the
gateway's own count, exact at every decision, where the engine's stats are a second old. Cache-aware routing is
SGLang's router's rule over the block names the replicas report (engine `CacheEvents`): a request goes to the
replica holding the longest cached prefix of its prompt, unless the loads are out of balance or no replica holds
enough of it, when it goes to the least loaded.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from typing import Literal, Protocol

from engine.core.kv_cache import chain_hash, salt_root
from engine.ipc.messages import CacheEvents, cache_key

RoutingPolicy = Literal["round-robin", "least-loaded", "cache-aware"]

# Cache-aware: loads are out of balance when the busiest replica holds this many more in-flight tokens than the
# idlest and this ratio of them (SGLang's router's two balance thresholds, counted in tokens rather than requests).
BALANCE_TOKENS = 2048
BALANCE_RATIO = 1.5
CACHE_THRESHOLD = 0.3  # share of the prompt a replica must hold cached to be chosen for it (SGLang's default)


class Replica(Protocol):
    index: int  # its position among the replicas, 0 first

    @property
    def load(self) -> int: ...  # tokens of its in-flight requests


class RoundRobin:
    """Each request to the next replica in turn."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, replicas: Sequence[Replica], prompt: list[int], cache_salt: bytes) -> tuple[Replica, str]:
        """The replica for this prompt, and why (a `reason` label of orcinus_routed_requests)."""
        return replicas[next(self._turn) % len(replicas)], "turn"

    def route(
        self, request_id: str, replicas: Sequence[Replica], prompt: list[int], cache_salt: bytes, lora: str = ""
    ) -> tuple[Replica, str]:
        """Choose `request_id`'s replica and remember it there until `done(request_id)`; `lora`: its adapter's name
        (engines/adapter_routing.py routes by it; the policies here route every request alike)."""
        return self.choose(replicas, prompt, cache_salt)

    def done(self, request_id: str) -> None:
        """`request_id` finished, failed or was aborted."""

    def cache_events(self, index: int, events: CacheEvents | None) -> None:
        """Blocks replica `index` cached and evicted; None: it restarted, its cache is empty."""

    def unloaded(self, name: str) -> None:
        """LoRA adapter `name` was unloaded from every replica."""


class LeastLoaded(RoundRobin):
    """The replica with the fewest in-flight tokens; ties in turn, so an idle server alternates."""

    def choose(self, replicas: Sequence[Replica], prompt: list[int], cache_salt: bytes) -> tuple[Replica, str]:
        start = next(self._turn) % len(replicas)
        return min(replicas[start:] + replicas[:start], key=lambda r: r.load), "load"


class CacheAware(LeastLoaded):
    """The replica with the longest cached prefix of the prompt, balanced against load."""

    def __init__(self, num_replicas: int, block_size: int):
        super().__init__()
        self.block_size = block_size
        self.cached: list[set[int]] = [set() for _ in range(num_replicas)]  # what each engine says it has cached
        # Blocks of requests in flight on each replica: cached there soon, before its engine says so.
        self.pending: list[Counter[int]] = [Counter() for _ in range(num_replicas)]
        self.in_flight: dict[str, tuple[int, list[int]]] = {}

    def choose(self, replicas: Sequence[Replica], prompt: list[int], cache_salt: bytes) -> tuple[Replica, str]:
        return self._choose(replicas, len(prompt), self.keys(prompt, cache_salt))

    def route(
        self, request_id: str, replicas: Sequence[Replica], prompt: list[int], cache_salt: bytes, lora: str = ""
    ) -> tuple[Replica, str]:
        keys = self.keys(prompt, cache_salt)  # hashed once, for the choice and for the blocks it will hold
        replica, reason = self._choose(replicas, len(prompt), keys)
        self.pending[replica.index].update(keys)
        self.in_flight[request_id] = (replica.index, keys)
        return replica, reason

    def _choose(self, replicas: Sequence[Replica], num_tokens: int, keys: list[int]) -> tuple[Replica, str]:
        loads = [r.load for r in replicas]
        if max(loads) - min(loads) > BALANCE_TOKENS and max(loads) > BALANCE_RATIO * min(loads):
            return super().choose(replicas, [], b"")[0], "balance"
        matched = [self.matched(r.index, keys) for r in replicas]
        best = max(range(len(replicas)), key=lambda i: (matched[i], -loads[i]))
        if matched[best] * self.block_size < CACHE_THRESHOLD * num_tokens:
            return super().choose(replicas, [], b"")
        return replicas[best], "cache"

    def done(self, request_id: str) -> None:
        entry = self.in_flight.pop(request_id, None)
        if entry is not None:
            index, keys = entry
            pending = self.pending[index]
            for key in keys:
                if pending[key] > 1:
                    pending[key] -= 1
                else:
                    del pending[key]

    def cache_events(self, index: int, events: CacheEvents | None) -> None:
        cached = self.cached[index]
        if events is None:
            cached.clear()
            return
        for key in events.stored:
            cached.add(key)
        for key in events.removed:
            cached.discard(key)

    def keys(self, prompt: list[int], cache_salt: bytes) -> list[int]:
        """The routing keys of the prompt's full blocks that an engine could find cached (the last token never is)."""
        bs = self.block_size
        parent, keys = salt_root(cache_salt), []
        for i in range((len(prompt) - 1) // bs):
            parent = chain_hash(parent, prompt[i * bs : (i + 1) * bs])
            keys.append(cache_key(parent))
        return keys

    def matched(self, index: int, keys: list[int]) -> int:
        """Leading blocks of `keys` replica `index` holds or will hold."""
        cached, pending = self.cached[index], self.pending[index]
        n = 0
        for key in keys:
            if key not in cached and key not in pending:
                break
            n += 1
        return n


def make_router(policy: RoutingPolicy, num_replicas: int, block_size: int) -> RoundRobin:
    if policy == "round-robin":
        return RoundRobin()
    if policy == "least-loaded":
        return LeastLoaded()
    if policy == "cache-aware":
        return CacheAware(num_replicas, block_size)
    raise ValueError(f"unknown routing policy {policy!r}")
