"""LoRA adapters as a pool: which loaded adapters are resident in the executor's `max_loras` slots, and the requests
waiting for theirs.

A request under an adapter holds the adapter's slot from the moment it enters the scheduler until it finishes or is
aborted, so a slot is never reloaded under a running request. One whose adapter has no slot (every slot held) waits
here, outside the scheduler, and the step goes on with the others; it enters once a slot frees. So that a stream of
requests under resident adapters cannot keep every slot held forever, the least held adapter then takes no new
requests (they wait too) until its slot has gone to the waiting one. A resident adapter no request holds stays
loaded until its slot is needed (least recently used first).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable

from engine.core.request import Request, RequestStatus
from engine.core.sampling_params import InvalidRequestError


class AdapterError(ValueError):
    """An adapter that cannot be loaded (files, rank, modules), or a name that is not loaded."""


class AdapterNotFoundError(AdapterError):
    """No adapter of that name is loaded."""


class UnknownModelError(InvalidRequestError):
    """A request names an adapter that is not loaded (or was unloaded before it could run): a 404, as the gateway
    answers a model name it does not serve."""

    def __init__(self, name: str):
        super().__init__(f"The model `{name}` does not exist.", "model")


class LoraPool:
    """Loaded adapters by name (each with an id never reused, so a name loaded again is another adapter to the prefix
    cache) and the slots they are resident in."""

    def __init__(self, max_loras: int):
        if max_loras < 1:
            raise ValueError(f"--max-loras must be 1 or more, got {max_loras}")
        self.ids: dict[str, int] = {}  # loaded names -> adapter id
        self.names: dict[int, str] = {}
        self._next_id = 1  # 0 is the base model
        self.slot_of: dict[int, int] = {}  # resident adapter id -> its slot
        self.free_slots = list(range(max_loras))
        self.users: Counter[int] = Counter()  # adapter id -> requests holding its slot
        self.idle: OrderedDict[int, None] = OrderedDict()  # resident, unheld, least recently used first

    def register(self, name: str) -> int:
        if name in self.ids:
            raise AdapterError(f"The lora adapter '{name}' has already been loaded.")
        adapter_id, self._next_id = self._next_id, self._next_id + 1
        self.ids[name], self.names[adapter_id] = adapter_id, name
        return adapter_id

    def unregister(self, name: str) -> int:
        """Forget `name`: its slot frees now if nobody holds it, else when its last request is done."""
        adapter_id = self.ids.pop(name, None)
        if adapter_id is None:
            raise AdapterNotFoundError(f"The lora adapter '{name}' cannot be found.")
        if adapter_id in self.idle:
            del self.idle[adapter_id]
            self._free(adapter_id)
        return adapter_id

    def acquire(self, adapter_id: int) -> tuple[int, bool] | None:
        """Hold the adapter's slot: (slot, whether it must be loaded there first), or None while every slot is held."""
        slot = self.slot_of.get(adapter_id)
        fresh = slot is None
        if fresh:
            if self.free_slots:
                slot = self.free_slots.pop(0)
            elif self.idle:
                victim, _ = self.idle.popitem(last=False)
                slot = self.slot_of.pop(victim)
            else:
                return None
            self.slot_of[adapter_id] = slot
        self.idle.pop(adapter_id, None)
        self.users[adapter_id] += 1
        return slot, fresh

    def release(self, adapter_id: int) -> None:
        self.users[adapter_id] -= 1
        if self.users[adapter_id] > 0:
            return
        del self.users[adapter_id]
        if adapter_id in self.names and self.names[adapter_id] in self.ids:
            self.idle[adapter_id] = None
        else:  # unloaded while it ran
            self._free(adapter_id)

    def _free(self, adapter_id: int) -> None:
        self.free_slots.append(self.slot_of.pop(adapter_id))
        self.free_slots.sort()

    @property
    def resident(self) -> dict[str, int]:
        """Loaded adapters in a slot, by name."""
        return {self.names[i]: s for i, s in self.slot_of.items() if self.names[i] in self.ids}


class AdapterGate:
    """Lets a request under an adapter into the scheduler once it holds the adapter's slot (`load` puts the adapter's
    weights there first when it was not resident); knows each scheduled request's slot."""

    def __init__(self, max_loras: int, load: Callable[[int, str], None]):
        self.pool = LoraPool(max_loras)
        self.load = load
        self.held: dict[str, Request] = {}  # waiting for a slot, in arrival order
        self.holding: dict[str, int] = {}  # request id -> adapter id, for requests past the gate
        self.draining: int | None = None  # the adapter whose slot goes to the oldest waiting request, once unheld

    def add(self, req: Request, enter: Callable[[Request], None]) -> None:
        """`enter(req)` now, or once its adapter has a slot; InvalidRequestError for an adapter not loaded."""
        name = req.options.lora
        if not name:
            enter(req)
            return
        adapter_id = self.pool.ids.get(name)
        if adapter_id is None:
            raise UnknownModelError(name)
        req.lora_id = adapter_id
        if self._take(req):
            enter(req)
        else:
            self.held[req.request_id] = req

    def admit_held(self, enter: Callable[[Request], None]) -> None:
        """Let in the waiting requests whose adapters now get a slot (each tries in arrival order)."""
        for _ in range(2):  # again once the drained slot has gone: who waits still picks the next to drain
            for request_id, req in list(self.held.items()):
                if self._take(req):
                    del self.held[request_id]
                    enter(req)
            if self.draining is None or (self.held and self.draining in self.pool.users):
                return
            self.draining = None

    def _take(self, req: Request) -> bool:
        if req.lora_id == self.draining:
            return False
        got = self.pool.acquire(req.lora_id)
        if got is None:
            if self.draining is None:
                self.draining = min(self.pool.users, key=self.pool.users.__getitem__)
            return False
        slot, fresh = got
        if fresh:
            self.load(slot, self.pool.names[req.lora_id])
        self.holding[req.request_id] = req.lora_id
        return True

    def done(self, request_ids: list[str]) -> None:
        """These requests finished or were aborted: their slots may go to others."""
        for request_id in request_ids:
            adapter_id = self.holding.pop(request_id, None)
            if adapter_id is not None:
                self.pool.release(adapter_id)

    def abort(self, request_id: str) -> Request | None:
        """Drop a request still waiting for a slot (None if it is not waiting here)."""
        req = self.held.pop(request_id, None)
        if req is not None:
            req.status = RequestStatus.FINISHED_ABORTED
        return req

    def unload(self, name: str) -> list[Request]:
        """Forget an adapter; returns the requests that were waiting for it (they can no longer run)."""
        adapter_id = self.pool.unregister(name)
        dropped = [r for r in self.held.values() if r.lora_id == adapter_id]
        for r in dropped:
            del self.held[r.request_id]
        return dropped

    def slots(self, request_ids: list[str]) -> list[int]:
        """Each request's slot (-1: the base model)."""
        slot_of, holding = self.pool.slot_of, self.holding
        return [slot_of[holding[r]] if r in holding else -1 for r in request_ids]


def parse_lora(spec: str) -> tuple[str, str]:
    """--lora's NAME=PATH -> (name, path)."""
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--lora takes NAME=PATH, got {spec!r}")
    return name, path
