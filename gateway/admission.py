"""Admission control: a bounded number of sequences sent to the engine and not yet finished.

The gateway counts every sequence it has submitted (a request with `p` prompts and `n` choices is
`p * n`) until it finishes, fails or is aborted. The engine runs at most `max_running` of them at once;
the rest wait in its queue. Past `max_running + max_waiting`, a request is refused at once with 429 and
`Retry-After` rather than queued: a longer queue would only add to the latency of everyone admitted.
The count lives in the gateway's event loop, so the check is exact and needs no round trip.
"""

from __future__ import annotations

from engine.core.request_limits import RequestLimits
from gateway import errors
from gateway.metrics import Metrics

RETRY_AFTER = 1.0  # seconds a refused client is asked to wait; sequences finish every few iterations


class Admission:
    """Counts admitted sequences; `admit` hands out a Ticket or raises 429 (or 400 if it could never fit)."""

    def __init__(self, max_running: int, max_waiting: int | None, metrics: Metrics):
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.metrics = metrics
        self.in_flight = 0

    def capacity(self, limits: RequestLimits) -> int:
        """Sequences admitted at once. By default the queue holds one more batch, or fewer if the KV cache
        cannot start that many (each needs at least one block), so a waiter waits about one generation."""
        waiting = self.max_waiting
        if waiting is None:
            waiting = min(self.max_running, limits.num_kv_blocks)
        return self.max_running + waiting

    def admit(self, num_sequences: int, limits: RequestLimits) -> Ticket:
        capacity = self.capacity(limits)
        if num_sequences > capacity:
            raise errors.invalid_request(
                f"The request needs {num_sequences} sequences (prompts x n); this server admits at most "
                f"{capacity} at once.", "n")
        if self.in_flight + num_sequences > capacity:
            self.metrics.rejected.inc()
            raise errors.rate_limited(
                f"The server is at capacity ({capacity} sequences in flight or queued); retry later.", RETRY_AFTER)
        self._change(num_sequences)
        return Ticket(self, num_sequences)

    def _change(self, delta: int) -> None:
        self.in_flight += delta
        self.metrics.admitted.set(self.in_flight)


class Ticket:
    """The admitted sequences of one request; each is given back once (release), the rest on close."""

    def __init__(self, admission: Admission, held: int):
        self._admission = admission
        self.held = held

    def release(self, count: int = 1) -> None:
        count = min(count, self.held)
        if count > 0:
            self.held -= count
            self._admission._change(-count)

    def close(self) -> None:
        self.release(self.held)
