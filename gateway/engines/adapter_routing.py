"""Routing of LoRA requests over data-parallel replicas: to a replica that has the adapter resident in a slot.

Every replica loads every adapter, but only `--max-loras` are resident in each one's slots; a request under an
adapter no slot holds waits until one frees and its weights are copied in. So an adapter request goes to the least
loaded replica that has its adapter resident, unless the loads are out of balance (as cache-aware routing's rule),
else to the least loaded replica. Residency is the gateway's own model of each engine's pool (engine/core/lora_pool.py),
fed by its routing decisions: a replica's adapters in flight stay resident, the others go least recently used first.
Base-model requests are routed by the policy underneath.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence

from engine.ipc.messages import CacheEvents
from gateway.engines.routing import BALANCE_RATIO, BALANCE_TOKENS, LeastLoaded, Replica, RoundRobin


class AdapterAware(RoundRobin):
    """Adapter requests to a replica holding their adapter; the others to `inner`'s choice."""

    def __init__(self, inner: RoundRobin, num_replicas: int, max_loras: int):
        super().__init__()
        self.inner, self.max_loras = inner, max_loras
        self.fallback = LeastLoaded()
        # Per replica: its adapters thought resident, least recently used first, and its requests under each.
        self.resident: list[OrderedDict[str, None]] = [OrderedDict() for _ in range(num_replicas)]
        self.users: list[Counter[str]] = [Counter() for _ in range(num_replicas)]
        self.in_flight: dict[str, tuple[int, str]] = {}

    def choose(
        self, replicas: Sequence[Replica], prompt: list[int], cache_salt: bytes, lora: str = ""
    ) -> tuple[Replica, str]:
        if not lora:
            return self.inner.choose(replicas, prompt, cache_salt)
        least = min(r.load for r in replicas)
        holding = [r for r in replicas if lora in self.resident[r.index]]
        if holding:
            best = min(holding, key=lambda r: r.load)
            if not (best.load - least > BALANCE_TOKENS and best.load > BALANCE_RATIO * least):
                return best, "lora"
        return self.fallback.choose(replicas, prompt, cache_salt)[0], "load"

    def route(
        self, request_id: str, replicas: Sequence[Replica], prompt: list[int], cache_salt: bytes, lora: str = ""
    ) -> tuple[Replica, str]:
        if not lora:
            return self.inner.route(request_id, replicas, prompt, cache_salt)
        replica, reason = self.choose(replicas, prompt, cache_salt, lora)
        index = replica.index
        self.users[index][lora] += 1
        self.resident[index][lora] = None
        self.resident[index].move_to_end(lora)
        self._evict(index)
        self.in_flight[request_id] = index, lora
        return replica, reason

    def done(self, request_id: str) -> None:
        entry = self.in_flight.pop(request_id, None)
        if entry is None:
            self.inner.done(request_id)
            return
        index, lora = entry
        users = self.users[index]
        users[lora] -= 1
        if users[lora] <= 0:
            del users[lora]
            if lora in self.resident[index]:
                self.resident[index].move_to_end(lora)  # the engine's pool: released last, evicted last
        self._evict(index)

    def _evict(self, index: int) -> None:
        """Over `max_loras`, the least recently used adapters no request holds leave (held ones wait in the engine)."""
        resident, users = self.resident[index], self.users[index]
        for name in [n for n in resident if n not in users][: max(0, len(resident) - self.max_loras)]:
            del resident[name]

    def cache_events(self, index: int, events: CacheEvents | None) -> None:
        if events is None:  # the replica restarted: its slots are empty
            self.resident[index].clear()
        self.inner.cache_events(index, events)

    def unloaded(self, name: str) -> None:
        """The adapter was unloaded everywhere: a later one of the same name is resident nowhere yet."""
        for resident in self.resident:
            resident.pop(name, None)
