"""Scheduler and KV cache invariants, driven by fake model outputs (no model)."""

import pytest

from engine.core.config import EngineConfig
from engine.core.request import Request, RequestOptions, RequestStatus, SampledTokens
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler

BS = 4  # small blocks make the arithmetic visible


def make(num_blocks=64, **cfg) -> Scheduler:
    config = EngineConfig(block_size=BS, **{"max_num_batched_tokens": 256, **cfg})
    return Scheduler(config, num_blocks, max_model_len=1024)


def req(rid, prompt_len=6, max_tokens=4, **params) -> Request:
    # Prompts differ per id, so no request finds another's blocks in the prefix cache (tests/test_prefix_cache.py).
    base = 1000 * (1 + sum(map(ord, rid)))
    return Request(
        rid, list(range(base, base + prompt_len)), SamplingParams(max_tokens=max_tokens, **params), eos_token_id=0
    )


def step(s: Scheduler, token=7):
    """One fake iteration: every sampling request gets `token`. Returns {id: num tokens computed}."""
    batch = s.schedule()
    s.update(batch, {r.request_id: SampledTokens([token]) for r in batch.requests if r.sample})
    return {r.request_id: len(r.token_ids) for r in batch.requests}


def test_new_request_joins_the_very_next_iteration():
    s = make()
    s.add(req("a", max_tokens=10))
    assert step(s) == {"a": 6}
    assert step(s) == {"a": 1}
    s.add(req("b", prompt_len=5))
    assert step(s) == {"a": 1, "b": 5}  # prefill of b batched with the decode of a
    assert step(s) == {"a": 1, "b": 1}


def test_finished_request_leaves_at_end_of_its_iteration_and_frees_blocks():
    s = make(num_blocks=10)
    s.add(req("a", prompt_len=6, max_tokens=2))
    s.add(req("b", prompt_len=6, max_tokens=5))
    step(s)  # prefill both; each samples its first token
    assert s.kv.num_free_blocks == 10 - 2 - 2
    assert step(s) == {"a": 1, "b": 1}  # a samples its 2nd (last) token here
    assert s.requests.keys() == {"b"}
    assert s.kv.num_free_blocks == 10 - 2  # a's two blocks are back; b holds ceil(7/4)=2
    assert step(s) == {"b": 1}
    assert step(s) == {"b": 1}
    assert step(s) == {"b": 1}  # b's 5th token
    assert not s.has_unfinished()
    assert s.kv.num_free_blocks == 10
    assert sorted(s.kv.free_queue) == list(range(10)) and all(n == 0 for n in s.kv.ref_counts)


def test_stop_token_finishes_with_stop_and_respects_min_tokens():
    s = make()
    a = req("a", max_tokens=8)
    b = req("b", max_tokens=8, min_tokens=3)
    s.add(a)
    s.add(b)
    step(s, token=0)  # eos for both
    assert a.status == RequestStatus.FINISHED_STOPPED and a.output_token_ids == [0]
    assert b.status == RequestStatus.RUNNING  # the sampler masks eos below min_tokens; the scheduler agrees
    step(s, token=0)
    step(s, token=0)
    assert b.status == RequestStatus.FINISHED_STOPPED and b.num_output_tokens == 3


def test_ignore_eos_and_extra_stop_ids():
    s = make()
    a = req("a", max_tokens=3, ignore_eos=True)
    b = req("b", max_tokens=3, stop_token_ids=(7,))
    s.add(a)
    s.add(b)
    step(s, token=0)
    assert a.status == RequestStatus.RUNNING and b.status == RequestStatus.FINISHED_STOPPED
    step(s, token=7)
    step(s, token=0)
    assert a.status == RequestStatus.FINISHED_LENGTH and a.output_token_ids == [0, 7, 0]
    c = req("c", max_tokens=3, stop_token_ids=(7,))
    s.add(c)
    step(s, token=5)
    step(s, token=7)
    assert c.status == RequestStatus.FINISHED_STOPPED and c.output_token_ids == [5, 7]


def test_fcfs_under_block_pressure_no_overtaking():
    s = make(num_blocks=6)
    s.add(req("a", prompt_len=12, max_tokens=4))  # 3 blocks
    s.add(req("big", prompt_len=16, max_tokens=4))  # needs 4 blocks: does not fit next to a
    s.add(req("small", prompt_len=2, max_tokens=1))  # would fit, but must not overtake big
    assert step(s) == {"a": 12}
    assert [r.request_id for r in s.waiting] == ["big", "small"]
    while "a" in s.requests:
        assert "small" not in step(s)
    assert step(s) == {"big": 16, "small": 2}


def test_priority_policy_admits_lower_first_and_arrival_order_among_equals():
    s = make(num_blocks=6, scheduling_policy="priority")
    s.add(req("a", prompt_len=12, max_tokens=4))  # 3 blocks: alone, it is admitted at once
    step(s)
    for rid, priority in [("late", 5), ("first", -1), ("second", 0), ("third", 0)]:
        r = req(rid, prompt_len=4, max_tokens=2)
        r.options = RequestOptions(priority=priority)
        s.add(r)
    assert [r.request_id for r in s.waiting] == ["first", "second", "third", "late"]


def test_priority_policy_preempts_the_highest_priority_value_not_the_newest():
    s = make(num_blocks=4, scheduling_policy="priority")
    low, high = req("low", prompt_len=4, max_tokens=8), req("high", prompt_len=4, max_tokens=8)
    low.options, high.options = RequestOptions(priority=3), RequestOptions(priority=0)
    s.add(low)
    s.add(high)  # admitted after low: under FCFS it would be the one to go
    assert step(s) == {"high": 4, "low": 4}
    for _ in range(4):
        step(s)  # tokens 5..8 fill the two blocks each holds; the pool is empty
    assert step(s) == {"high": 1}  # token 9 needs a block: low gives up its own
    assert low.status == RequestStatus.WAITING and low.num_preemptions == 1 and high.num_preemptions == 0


def test_preempts_newest_when_blocks_run_out_and_recomputes_it():
    s = make(num_blocks=4)
    old, new = req("old", prompt_len=4, max_tokens=8), req("new", prompt_len=4, max_tokens=8)
    s.add(old)
    s.add(new)
    assert step(s) == {"old": 4, "new": 4}  # 1 block each
    assert step(s) == {"old": 1, "new": 1}  # token 5 opens a 2nd block each: the pool is empty
    assert s.kv.num_free_blocks == 0
    for _ in range(3):  # tokens 6..8 fit in the blocks they hold
        assert step(s) == {"old": 1, "new": 1}
    # Token 9 needs a 3rd block; old gets it by evicting the newest request.
    assert step(s) == {"old": 1}
    assert new.status == RequestStatus.WAITING and new.num_computed_tokens == 0 and new.block_table == []
    assert new.num_preemptions == 1 and new.output_token_ids == [7] * 5
    assert list(s.waiting) == [new]
    while "old" in s.requests:
        assert "new" not in step(s)
    # Recompute: the prompt plus the tokens it had generated, in one prefill, less its first block: the prefix
    # cache still holds it (its second went to old, which evicted it).
    assert step(s) == {"new": 9 - BS}
    assert s.prefix_hit_tokens == BS
    assert new.num_output_tokens == 6
    while s.has_unfinished():
        step(s)
    assert new.output_token_ids == [7] * 8 and s.kv.num_free_blocks == 4


def test_with_batches_in_flight_the_oldest_waits_for_the_newest_rather_than_preempting_itself():
    """Two pipeline stages (two batches in flight) and blocks for one request at a time: short of blocks while the
    newer request's batch is in flight, the older one waits for it to come back (and give its blocks up) instead of
    giving up its own; else each preempts itself in turn and neither ever finishes."""
    s = make(num_blocks=3, max_num_batched_tokens=4, prefix_caching=False)
    old, new = req("old", prompt_len=8, max_tokens=2), req("new", prompt_len=8, max_tokens=2)  # 3 blocks each
    s.add(old)
    s.add(new)
    in_flight, rows = [], []
    for _ in range(30):
        while len(in_flight) < 2 and len(batch := s.schedule(num_batches=2 - len(in_flight))):
            in_flight.append(batch)
        if not in_flight:
            break
        batch = in_flight.pop(0)
        rows.append([(r.request_id, r.num_computed_tokens) for r in batch.requests])
        s.update(batch, {r.request_id: SampledTokens([7]) for r in batch.requests if r.sample})
    assert old.num_preemptions == 0 and old.status == RequestStatus.FINISHED_LENGTH
    assert [start for row in rows for rid, start in row if rid == "old"] == [0, 4, 8]  # its prompt, then a decode
    assert new.status == RequestStatus.FINISHED_LENGTH and s.kv.num_free_blocks == 3


def test_request_level_admits_nothing_until_the_batch_drains():
    s = make(scheduling="request")
    s.add(req("a", max_tokens=2))
    s.add(req("b", max_tokens=4))
    assert step(s) == {"a": 6, "b": 6}
    s.add(req("c", max_tokens=1))
    assert step(s) == {"a": 1, "b": 1}  # a finishes here; c still waits
    assert step(s) == {"b": 1}
    assert step(s) == {"b": 1}  # b's last token
    assert step(s) == {"c": 6}


def test_iteration_level_admits_into_a_running_batch():
    s = make(scheduling="iteration")
    s.add(req("a", max_tokens=4))
    step(s)
    s.add(req("c", max_tokens=1))
    assert step(s) == {"a": 1, "c": 6}


def test_token_budget_chunks_long_prefills_fcfs():
    s = make(max_num_batched_tokens=8)
    s.add(req("a", prompt_len=20, max_tokens=2))
    s.add(req("b", prompt_len=3, max_tokens=2))
    assert step(s) == {"a": 8}
    assert step(s) == {"a": 8}
    assert step(s) == {"a": 4, "b": 3}  # a's last chunk samples; b fits in what is left
    a = s.requests["a"]
    assert a.num_output_tokens == 1 and a.num_computed_tokens == 20


def test_max_num_seqs_caps_the_batch():
    s = make(max_num_seqs=2)
    for rid in "abc":
        s.add(req(rid, max_tokens=3))
    assert step(s) == {"a": 6, "b": 6}
    assert s.num_waiting == 1


def test_orca_reserve_holds_max_tokens_slots_from_admission():
    s = make(num_blocks=8, kv_policy="orca-reserve")
    s.add(req("a", prompt_len=4, max_tokens=12))  # 16 slots = 4 blocks up front
    s.add(req("b", prompt_len=4, max_tokens=12))
    s.add(req("c", prompt_len=4, max_tokens=12))
    assert step(s) == {"a": 4, "b": 4}
    assert s.kv.num_free_blocks == 0
    paged = make(num_blocks=8, kv_policy="paged")
    for rid in "abc":
        paged.add(req(rid, prompt_len=4, max_tokens=12))
    assert step(paged) == {"a": 4, "b": 4, "c": 4}


@pytest.mark.parametrize("where", ["waiting", "running"])
def test_abort_frees_blocks(where):
    s = make(num_blocks=8)
    s.add(req("a", max_tokens=5))
    if where == "running":
        step(s)
        assert s.kv.num_free_blocks == 6
    aborted = s.abort("a")
    assert aborted.status == RequestStatus.FINISHED_ABORTED
    assert s.kv.num_free_blocks == 8 and not s.has_unfinished()
    assert s.abort("a") is None
