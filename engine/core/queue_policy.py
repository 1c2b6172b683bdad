"""Who is admitted next (`--scheduling-policy`): the order of the scheduler's waiting queue.

`fcfs` is Orca's: arrival order. `priority` is vLLM's `priority` request field: lower runs first, arrival order
among equals. A preempted request goes back to the place its key gives it, so under FCFS it is in front of
everybody who arrived after it, as before.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

from engine.core.request import Request


class Fcfs:
    """Orca's order: arrival."""

    @staticmethod
    def key(req: Request) -> tuple:
        return (req.arrival_order,)

    @staticmethod
    def rank(req: Request) -> int:
        """Who gives up its blocks first when they run out: the highest rank, the newest admitted among equals."""
        return 0


class Priority:
    """vLLM's `priority` field: lower first, arrival order among equals; preemption takes the highest first."""

    @staticmethod
    def key(req: Request) -> tuple:
        return (req.priority, req.arrival_order)

    @staticmethod
    def rank(req: Request) -> int:
        return req.priority


QUEUE_POLICIES = {"fcfs": Fcfs, "priority": Priority}


class WaitingQueue:
    """Waiting requests, kept sorted by the policy's key, computed when each is added."""

    def __init__(self, policy: type[Fcfs] | type[Priority]):
        self.policy = policy
        self._keys: list[tuple] = []  # sorted; each ends with the request's arrival order, so no two are equal
        self._requests: list[Request] = []  # in the same order

    def add(self, req: Request) -> None:
        key = self.policy.key(req)
        i = bisect.bisect(self._keys, key)
        self._keys.insert(i, key)
        self._requests.insert(i, req)

    @property
    def first(self) -> Request:
        return self._requests[0]

    def pop_first(self) -> Request:
        del self._keys[0]
        return self._requests.pop(0)

    def remove(self, req: Request) -> None:
        i = self._requests.index(req)
        del self._keys[i], self._requests[i]

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)
