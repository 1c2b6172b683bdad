"""Admission control without a server: the count of admitted sequences is exact, and past the capacity a
request is refused at once (429 with Retry-After), or with a 400 when it could never fit."""

import pytest

from engine.core.request_limits import RequestLimits
from gateway import errors
from gateway.admission import Admission
from gateway.metrics import Metrics

LIMITS = RequestLimits(max_model_len=2048, vocab_size=100, num_kv_blocks=1000, block_size=16)


def test_capacity_is_the_batch_plus_the_queue_and_defaults_to_one_more_batch():
    assert Admission(8, 4, Metrics()).capacity(LIMITS) == 12
    assert Admission(8, 0, Metrics()).capacity(LIMITS) == 8
    assert Admission(8, None, Metrics()).capacity(LIMITS) == 16
    # A KV cache that cannot start a whole second batch (one block each) shortens the default queue.
    few_blocks = RequestLimits(max_model_len=64, vocab_size=100, num_kv_blocks=3, block_size=16)
    assert Admission(8, None, Metrics()).capacity(few_blocks) == 11


def test_sequences_are_counted_exactly_and_the_excess_is_refused_with_retry_after():
    metrics = Metrics()
    admission = Admission(2, 4, metrics)  # capacity 6
    first = admission.admit(4, LIMITS)  # e.g. 2 prompts x n=2
    second = admission.admit(2, LIMITS)
    assert admission.in_flight == 6 and metrics.registry.get_sample_value("orcinus_sequences_admitted") == 6
    with pytest.raises(errors.APIError) as refused:
        admission.admit(1, LIMITS)
    e = refused.value
    assert (e.status, e.type, e.code) == (429, "rate_limit_error", "rate_limit_exceeded")
    assert e.headers == {"Retry-After": "1"}
    assert metrics.registry.get_sample_value("orcinus_requests_rejected_total") == 1
    assert admission.in_flight == 6  # a refusal takes nothing

    first.release()  # one choice finished
    assert admission.in_flight == 5
    third = admission.admit(1, LIMITS)
    first.close()  # the request ended: the rest of its sequences come back, once
    first.close()
    first.release()
    assert admission.in_flight == 3 and first.held == 0
    second.close()
    third.close()
    assert admission.in_flight == 0 and metrics.registry.get_sample_value("orcinus_sequences_admitted") == 0


def test_a_request_larger_than_the_capacity_is_invalid_not_rate_limited():
    admission = Admission(2, 4, Metrics())
    with pytest.raises(errors.APIError) as info:
        admission.admit(7, LIMITS)
    assert (info.value.status, info.value.param) == (400, "n")
    assert admission.in_flight == 0
