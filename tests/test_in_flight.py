"""The in-flight limit without a server: the counts of in-flight sequences and prompt tokens are exact; a burst
queues up to a memory bound, and past it a request is refused at once (429 with Retry-After), or with a 400 when
it could never fit."""

import pytest

from gateway.web import errors
from gateway.web.in_flight import DEFAULT_MAX_QUEUED_TOKENS, DEFAULT_MAX_WAITING, InFlightLimit
from gateway.web.metrics import Metrics


def test_the_default_queue_takes_a_burst_of_thousands():
    limit = InFlightLimit(32, None, Metrics())
    assert limit.capacity == 32 + DEFAULT_MAX_WAITING >= 4096
    tickets = [limit.reserve(1, 500) for _ in range(4000)]  # 2M prompt tokens queued
    assert limit.in_flight == 4000 and limit.in_flight_tokens == 2_000_000 < DEFAULT_MAX_QUEUED_TOKENS
    for t in tickets:
        t.close()
    assert (limit.in_flight, limit.in_flight_tokens) == (0, 0)


def test_sequences_are_counted_exactly_and_the_excess_is_refused_with_retry_after():
    metrics = Metrics()
    limit = InFlightLimit(2, 4, metrics)  # capacity 6
    first = limit.reserve(4, 40)  # e.g. 2 prompts x n=2
    second = limit.reserve(2, 6)
    assert limit.in_flight == 6 and metrics.registry.get_sample_value("orcinus_sequences_in_flight") == 6
    assert metrics.registry.get_sample_value("orcinus_sequences_admitted") == 6  # the deprecated name still reads
    with pytest.raises(errors.APIError) as refused:
        limit.reserve(1, 1)
    e = refused.value
    assert (e.status, e.type, e.code) == (429, "rate_limit_error", "rate_limit_exceeded")
    assert e.headers == {"Retry-After": "1"}
    assert metrics.registry.get_sample_value("orcinus_requests_rejected_total") == 1
    assert limit.in_flight == 6  # a refusal takes nothing

    first.release()  # one choice finished: its share of the prompt tokens comes back
    assert (limit.in_flight, limit.in_flight_tokens) == (5, 36)
    third = limit.reserve(1, 3)
    first.close()  # the request ended: the rest of its sequences and tokens come back, once
    first.close()
    first.release()
    assert (limit.in_flight, limit.in_flight_tokens) == (3, 9) and first.held == 0
    second.close()
    third.close()
    assert (limit.in_flight, limit.in_flight_tokens) == (0, 0)
    assert metrics.registry.get_sample_value("orcinus_sequences_in_flight") == 0


def test_the_prompt_token_bound_refuses_true_overload():
    limit = InFlightLimit(2, 100, Metrics(), max_queued_tokens=1000)
    held = limit.reserve(3, 900)
    with pytest.raises(errors.APIError) as refused:
        limit.reserve(1, 200)  # fits the sequence count, not the memory bound
    assert refused.value.status == 429 and refused.value.headers == {"Retry-After": "1"}
    held.close()
    limit.reserve(1, 200).close()


def test_a_request_larger_than_the_capacity_is_invalid_not_rate_limited():
    limit = InFlightLimit(2, 4, Metrics(), max_queued_tokens=1000)
    with pytest.raises(errors.APIError) as info:
        limit.reserve(7, 7)
    assert (info.value.status, info.value.param) == (400, "n")
    with pytest.raises(errors.APIError) as info:
        limit.reserve(1, 1001)
    assert (info.value.status, info.value.param) == (400, "prompt")
    assert (limit.in_flight, limit.in_flight_tokens) == (0, 0)
