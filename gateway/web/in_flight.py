"""The in-flight limit: what the gateway has sent to the engine and not yet seen finish, bounded by memory.

("Admission" is the scheduler's word, for a waiting request joining the running batch; this is the gateway's
bound on what it hands the engine at all.)

The gateway counts every sequence it has submitted (a request with `p` prompts and `n` choices is
`p * n`) and their prompt tokens until they finish, fail or are aborted. The engine runs at most
`max_running` sequences at once; the rest wait in its queue, as in vLLM and llama.cpp, so a burst of
a thousand clients is served, not refused. What bounds the queue is memory: a queued sequence costs
its prompt's ids in both processes and a Request in the engine, and nothing on the device until it
runs. Past `max_running + max_waiting` sequences or `max_queued_tokens` prompt tokens a request is
refused with 429 and `Retry-After`: that is true overload. The counts live in the gateway's event
loop, so the check is exact and needs no round trip.
"""

from __future__ import annotations

from gateway.web import errors
from gateway.web.metrics import Metrics

RETRY_AFTER = 1.0  # seconds a refused client is asked to wait; sequences finish every few iterations
DEFAULT_MAX_WAITING = 4096  # sequences queued beyond the batch: a Request and a Generation each, ~10 KB in all
# Prompt tokens in flight at once: as Python ints in lists in the gateway and the engine, ~0.3 GB at the bound.
DEFAULT_MAX_QUEUED_TOKENS = 4 * 1024 * 1024


class InFlightLimit:
    """Counts in-flight sequences and their prompt tokens; `reserve` hands out a Ticket or raises 429 (or 400 if
    the request could never fit)."""

    def __init__(
        self,
        max_running: int,
        max_waiting: int | None,
        metrics: Metrics,
        max_queued_tokens: int = DEFAULT_MAX_QUEUED_TOKENS,
    ):
        self.max_running = max_running
        self.max_waiting = DEFAULT_MAX_WAITING if max_waiting is None else max_waiting
        self.max_queued_tokens = max_queued_tokens
        self.metrics = metrics
        self.in_flight = 0  # sequences
        self.in_flight_tokens = 0  # their prompt tokens

    @property
    def capacity(self) -> int:
        """Sequences in flight at once: the engine's batch and its queue."""
        return self.max_running + self.max_waiting

    def reserve(self, num_sequences: int, num_tokens: int = 0) -> Ticket:
        """`num_tokens`: the prompt tokens of all `num_sequences` (each choice holds its prompt's)."""
        if num_sequences > self.capacity:
            raise errors.invalid_request(
                f"The request needs {num_sequences} sequences (prompts x n); this server admits at most "
                f"{self.capacity} at once.",
                "n",
            )
        if num_tokens > self.max_queued_tokens:
            raise errors.invalid_request(
                f"The request's prompts hold {num_tokens} tokens (counted once per choice); this server admits at "
                f"most {self.max_queued_tokens} at once.",
                "prompt",
            )
        if (
            self.in_flight + num_sequences > self.capacity
            or self.in_flight_tokens + num_tokens > self.max_queued_tokens
        ):
            self.metrics.rejected.inc()
            raise errors.rate_limited(
                f"The server is at capacity ({self.in_flight} sequences and {self.in_flight_tokens} prompt tokens "
                f"in flight or queued, of {self.capacity} and {self.max_queued_tokens}); retry later.",
                RETRY_AFTER,
            )
        self._change(num_sequences, num_tokens)
        return Ticket(self, num_sequences, num_tokens)

    def _change(self, sequences: int, tokens: int) -> None:
        self.in_flight += sequences
        self.in_flight_tokens += tokens
        self.metrics.in_flight.set(self.in_flight)
        self.metrics.admitted.set(self.in_flight)  # the deprecated name of the same gauge


class Ticket:
    """The in-flight sequences of one request; each is given back once (release), the rest on close."""

    def __init__(self, limit: InFlightLimit, held: int, tokens: int = 0):
        self._limit = limit
        self.held = held
        self.tokens = tokens  # prompt tokens still held: each sequence gives back its share, the last one the rest

    def release(self, count: int = 1) -> None:
        count = min(count, self.held)
        if count > 0:
            tokens = self.tokens if count == self.held else self.tokens * count // self.held
            self.held -= count
            self.tokens -= tokens
            self._limit._change(-count, -tokens)

    def close(self) -> None:
        self.release(self.held)
