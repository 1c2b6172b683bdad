"""Who runs first (`--scheduling-policy`): the order of the scheduler's waiting queue, and of its running requests
when more hold KV blocks than one iteration takes.

`fcfs` is Orca's: arrival order. `priority` is vLLM's `priority` request field: lower runs first, arrival order
among equals. `predicted`: shortest predicted remaining output first, from a length predictor that reads the
model's own hidden state (engine/model/length_predictor.py), aged so that nobody waits for ever. A preempted
request goes back to the place its key gives it, so under FCFS it is in front of everybody who arrived after it.

A length-aware policy keeps its requests' length bookkeeping (Request.length, a LengthState) through the hooks
the scheduler calls (QueuePolicy's); fcfs and priority implement none. A policy outside the engine (a benchmark's)
is named `module:name`: the engine imports `module`, in its own process too, and the module registers it.
"""

from __future__ import annotations

import bisect
import importlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Protocol

from engine.core.request import Request

log = logging.getLogger("orcinus.scheduler")

PROBE_EVERY = 16  # outputs between a request's length probes (the `predicted` policy)
LONG_POOL_TOKENS = 64  # a request predicted at least this long from its prompt is in the "long" pool (metrics)


class QueuePolicy:
    """The order (`key`, `rank`) and the hooks for a request's length, which do nothing here (fcfs and priority keep
    no length)."""

    RUNNING_PER_SEQ = 1  # requests that may hold KV blocks, per request an iteration takes (max_num_seqs)
    NEWCOMERS_ALONE = False  # new prompts join the running requests' decodes (Orca's selective batching)
    probing = False  # whether the scheduler asks `probes` at all (it would ask per request per step)

    def key(self, req: Request) -> tuple:
        """Its place in the waiting queue (and among the running, where more hold blocks than run): lowest first;
        ends with the request's arrival order, so no two are equal."""
        raise NotImplementedError

    def rank(self, req: Request) -> float:
        """Who gives up its blocks first when they run out: the highest rank, the newest admitted among equals."""
        raise NotImplementedError

    def probes(self, req: Request) -> bool:
        """Whether this step should return the final hidden state at the request's last known token (`probed`)."""
        return False

    def runs_long(self, req: Request) -> bool:
        """Whether the request may run several decode steps between check-ins (--check-in-steps): a policy that
        knows no lengths lets every request."""
        return True

    def probed(self, req: Request, hidden: list[float]) -> None:
        """A probe came back: the hidden state at the request's last known token, before this step's outputs."""

    def finished(self, req: Request) -> None:
        """The request ended, other than by an error."""

    def drain_length_outcomes(self) -> list[tuple[float, str, float]]:
        """Per request finished since the last call whose length was predicted: (prediction / real length, its
        pool "short" or "long", seconds it waited for admission)."""
        return []

    def close(self) -> None:
        """Keep what it learnt (where it learns)."""


class Fcfs(QueuePolicy):
    """Orca's order: arrival."""

    @staticmethod
    def key(req: Request) -> tuple:
        return (req.arrival_order,)

    @staticmethod
    def rank(req: Request) -> int:
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


@dataclass
class LengthState:
    """A request's length bookkeeping under a length-aware policy (Request.length)."""

    # (outputs so far, final hidden state at its last known token) per probe: what the predictor learns from
    probes: list[tuple[int, list[float]]] = field(default_factory=list)
    predicted: float | None = None  # the length predictor's latest estimate of its whole output
    first_predicted: float | None = None  # its estimate from the prompt alone (what metrics judge)


class Predicted(QueuePolicy):
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

    def __init__(self, predictor: LengthPredictor | None = None):
        self.predictor = predictor  # None: no probes, no predictions (every request keys at its arrival)
        self.length_outcomes: list[tuple[float, str, float]] = []  # since the last drain

    @property
    def probing(self) -> bool:
        return self.predictor is not None

    @staticmethod
    def remaining(req: Request) -> float:
        length = req.length
        if length is None or length.predicted is None:
            return 0.0
        left = req.params.max_tokens - req.num_output_tokens  # max_tokens bounds any prediction
        return max(1.0, min(float(left), length.predicted - req.num_output_tokens))

    @classmethod
    def rank(cls, req: Request) -> float:
        return req.arrival_time + cls.remaining(req) / cls.AGING

    @classmethod
    def key(cls, req: Request) -> tuple:
        return (cls.rank(req), req.arrival_order)

    def probes(self, req: Request) -> bool:
        """At its first sample (the prompt's last token), then every PROBE_EVERY outputs."""
        length = req.length
        return length is None or req.num_output_tokens - length.probes[-1][0] >= PROBE_EVERY

    def runs_long(self, req: Request) -> bool:
        """Predicted at least LONG_POOL_TOKENS more outputs (a request not yet predicted is checked every step);
        without a predictor, every request."""
        return self.predictor is None or self.remaining(req) >= LONG_POOL_TOKENS

    def probed(self, req: Request, hidden: list[float]) -> None:
        t = req.num_output_tokens
        if req.length is None:
            req.length = LengthState()
        length = req.length
        length.probes.append((t, hidden))
        remaining = self.predictor.predict(hidden, t)
        if remaining is not None:
            length.predicted = t + remaining
            if len(length.probes) == 1:
                length.first_predicted = length.predicted

    def finished(self, req: Request) -> None:
        length = req.length
        if length is None or self.predictor is None:
            return
        self.predictor.observe(length.probes, req.num_output_tokens)
        predicted = length.first_predicted
        if predicted is not None:
            pool = "short" if predicted < LONG_POOL_TOKENS else "long"
            self.length_outcomes.append((predicted / max(1, req.num_output_tokens), pool, req.queue_seconds or 0.0))

    def drain_length_outcomes(self) -> list[tuple[float, str, float]]:
        outcomes, self.length_outcomes = self.length_outcomes, []
        return outcomes

    def close(self) -> None:
        if self.predictor is not None:
            self.predictor.save()


QUEUE_POLICIES: dict[str, type[QueuePolicy]] = {"fcfs": Fcfs, "priority": Priority, "predicted": Predicted}
# Names that left the engine, and the names that replaced them: still accepted, with a warning.
RENAMED = {"oracle": "bench.serving.length_oracle:oracle"}


def register_policy(name: str, policy: type[QueuePolicy]) -> None:
    """Make `policy` known as `name` ("module:name" for a module outside the engine, which registers at import)."""
    QUEUE_POLICIES[name] = policy


def policy_name(name: str) -> str:
    """`name` as registered (a deprecated one replaced, with a warning); ValueError if no policy has it."""
    if name in RENAMED:
        log.warning("--scheduling-policy %s is deprecated: use %s", name, RENAMED[name])
        name = RENAMED[name]
    if name not in QUEUE_POLICIES and ":" in name:
        module = name.partition(":")[0]
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ValueError(f"scheduling policy {name!r}: cannot import {module}: {e}") from e
    if name not in QUEUE_POLICIES:
        raise ValueError(f"unknown scheduling policy {name!r}: {', '.join(QUEUE_POLICIES)}, or module:name")
    return name


def queue_policy(name: str) -> type[QueuePolicy]:
    """The policy class registered as `name` (see policy_name)."""
    return QUEUE_POLICIES[policy_name(name)]


class WaitingQueue:
    """Waiting requests, kept sorted by the policy's key, computed when each is added."""

    def __init__(self, policy: QueuePolicy):
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
