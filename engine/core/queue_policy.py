"""Who runs first (`--scheduling-policy`): the order of the scheduler's waiting queue, and of its running requests
when more hold KV blocks than one iteration takes.

`fcfs` is Orca's: arrival order. `priority` is vLLM's `priority` request field: lower runs first, arrival order
among equals. `predicted`: shortest predicted remaining output first, from a length predictor that reads the
model's own hidden state (engine/model/length_predictor.py), aged so that nobody waits for ever. A preempted
request goes back to the place its key gives it, so under FCFS it is in front of everybody who arrived after it.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import Protocol

from engine.core.request import Request


class Fcfs:
    """Orca's order: arrival."""

    RUNNING_PER_SEQ = 1  # requests that may hold KV blocks, per request an iteration takes (max_num_seqs)
    NEWCOMERS_ALONE = False  # new prompts join the running requests' decodes (Orca's selective batching)

    @staticmethod
    def key(req: Request) -> tuple:
        return (req.arrival_order,)

    @staticmethod
    def rank(req: Request) -> int:
        """Who gives up its blocks first when they run out: the highest rank, the newest admitted among equals."""
        return 0


class Priority(Fcfs):
    """vLLM's `priority` field: lower first, arrival order among equals; preemption takes the highest first."""

    @staticmethod
    def key(req: Request) -> tuple:
        return (req.options.priority, req.arrival_order)

    @staticmethod
    def rank(req: Request) -> int:
        return req.options.priority


class LengthPredictor(Protocol):
    """Predicts a request's remaining output from the final hidden state at its last known token."""

    def predict(self, hidden: list[float], num_output_tokens: int) -> float | None:
        """Tokens still to come after `num_output_tokens`; None while it has learnt too little to say."""

    def observe(self, probes: list[tuple[int, list[float]]], num_output_tokens: int) -> None:
        """A request finished with `num_output_tokens`; `probes` are its (outputs so far, hidden state) pairs."""

    def save(self) -> None:
        """Keep what it learnt (where it was given a file)."""


class Predicted:
    """Shortest predicted remaining work first, aged: a request's key is its arrival time plus its predicted
    remaining tokens over AGING, so one predicted L tokens longer than another counts as arriving L / AGING
    seconds later. Nobody arriving more than (its prediction / AGING) seconds after a request overtakes it: its
    wait is bounded. A request not yet predicted (no prefill yet) keys at its arrival, and new prompts run in an
    iteration of their own (never two in a row), so a first token (and its prediction) waits for no decode, only
    for the iteration under way. Requests hold KV blocks beyond the ones an iteration takes (`max_running`), so a
    short newcomer decodes beside, or instead of, long ones; when blocks run out the highest key is preempted
    first."""

    AGING = 50.0  # predicted tokens that one second of waiting makes up for
    RUNNING_PER_SEQ = 2  # requests that may hold KV blocks, per request an iteration takes (max_num_seqs)
    NEWCOMERS_ALONE = True  # a new prompt's iteration leaves the decodes out: its first token waits for none

    @staticmethod
    def remaining(req: Request) -> float:
        if req.predicted_output_tokens is None:
            return 0.0
        left = req.params.max_tokens - req.num_output_tokens  # max_tokens bounds any prediction
        return max(1.0, min(float(left), req.predicted_output_tokens - req.num_output_tokens))

    @classmethod
    def rank(cls, req: Request) -> float:
        return req.arrival_time + cls.remaining(req) / cls.AGING

    @classmethod
    def key(cls, req: Request) -> tuple:
        return (cls.rank(req), req.arrival_order)


class Oracle(Predicted):
    """`predicted` with the true lengths: each request's `priority` field carries its real output length. A
    benchmark's ceiling (loadtest/bench_length_aware.py measures them first), not a policy for users."""

    @staticmethod
    def remaining(req: Request) -> float:
        return max(1.0, float(min(req.options.priority, req.params.max_tokens) - req.num_output_tokens))


QUEUE_POLICIES = {"fcfs": Fcfs, "priority": Priority, "predicted": Predicted, "oracle": Oracle}


class WaitingQueue:
    """Waiting requests, kept sorted by the policy's key, computed when each is added."""

    def __init__(self, policy: type[Fcfs | Predicted]):  # Priority and Oracle are their subclasses
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
