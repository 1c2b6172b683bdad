"""--check-in-steps: a batch of long decodes runs K steps per executor call with the tokens, stops and blocks of K
single steps."""

import pytest
import torch
from conftest import ByHidden, decode_ready

from engine.core.config import EngineConfig
from engine.core.queue_policy import Predicted
from engine.core.request import Request, SampledTokens
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.launch import build_engine
from engine.model.loader import load_checkpoint
from engine.runner.device import kv_bytes_per_block
from engine.runner.kv_dtype import CPU_AUTO_KV_DTYPE
from gateway.api.detokenizer import IncrementalDetokenizer

PROMPTS = [[5, 17, 300, 42], [7, 8, 9], [1000, 2000, 3000, 4000, 5000, 6], [11, 12]]


@pytest.fixture(scope="module")
def tiny():
    return load_checkpoint("dummy:tiny")


def engine(ckpt, k, **cfg):
    config = {"device": "cpu", "dtype": "float32", "speculative": "off", "check_in_steps": k, **cfg}
    return build_engine(EngineConfig(**config), ckpt)


def run(e, prompts, params) -> list[Request]:
    """Every request to the end; afterwards every block is free and the sampler keeps nothing."""
    reqs = [e.add_request(p, params[i] if isinstance(params, list) else params) for i, p in enumerate(prompts)]
    while e.has_unfinished():
        e.step()
    assert e.scheduler.kv.num_free_blocks == e.scheduler.kv.num_blocks
    assert not e.executor.sampler.states
    return reqs


def test_greedy_tokens_and_max_tokens_are_the_same_for_k_1_4_8(tiny):
    # max_tokens that no K divides: the runs end mid-way, exactly at each request's limit.
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (9, 13, 17, 6)]
    outs, iterations = {}, {}
    for k in (1, 4, 8):
        e = engine(tiny, k)
        reqs = run(e, PROMPTS, params)
        outs[k] = [(r.output_token_ids, r.finish_reason) for r in reqs]
        iterations[k] = e.num_iterations
    assert [len(t) for t, _ in outs[1]] == [9, 13, 17, 6]
    assert all(reason == "length" for _, reason in outs[1])
    assert outs[4] == outs[1] and outs[8] == outs[1]
    assert iterations[8] < iterations[4] < iterations[1]  # the runs really took several steps per check-in


def test_async_scheduling_waits_for_the_check_in_rather_than_run_ahead(tiny):
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (9, 13)]
    want = [r.output_token_ids for r in run(engine(tiny, 1), PROMPTS[:2], params)]
    e = engine(tiny, 4, async_scheduling="on")
    assert [r.output_token_ids for r in run(e, PROMPTS[:2], params)] == want
    assert e.num_iterations == 4  # the prompts (their first tokens), then 3 runs of 4: nothing ran ahead


def test_seeded_sampling_draws_the_same_tokens_with_k_4(tiny):
    params = [
        SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=100 + i, ignore_eos=True) for i in range(4)
    ]
    want = [r.output_token_ids for r in run(engine(tiny, 1), PROMPTS, params)]
    got = [r.output_token_ids for r in run(engine(tiny, 4), PROMPTS, params)]
    assert got == want


def test_a_stop_token_mid_run_ends_its_request_there_and_the_others_go_on(tiny):
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    ref = [r.output_token_ids for r in run(engine(tiny, 1), PROMPTS, free)]
    # A token first generated at output 6 or later of request 0: with K = 4 it lands in the second run or later.
    at = next(i for i in range(5, 12) if ref[0][i] not in ref[0][:i])
    stop = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=(ref[0][at],))
    e = engine(tiny, 4)
    reqs = run(e, PROMPTS, [stop, free, free, free])
    assert reqs[0].output_token_ids == ref[0][: at + 1]
    assert reqs[0].finish_reason == "stop"
    assert [r.output_token_ids for r in reqs[1:]] == ref[1:]


def test_min_tokens_masks_the_stop_token_inside_a_run(tiny):
    free = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ref = run(engine(tiny, 1), PROMPTS[:1], free)[0].output_token_ids
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop_token_ids=(ref[2],), min_tokens=6)
    want = run(engine(tiny, 1), PROMPTS[:1], params)[0]
    got = run(engine(tiny, 8), PROMPTS[:1], params)[0]
    assert (got.output_token_ids, got.finish_reason) == (want.output_token_ids, want.finish_reason)


def test_an_abort_during_a_run_delivers_none_of_its_tokens(tiny):
    e = engine(tiny, 8)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    a, b = e.add_request(PROMPTS[0], params), e.add_request(PROMPTS[1], params)
    e.step()  # the prompts; each has its first token
    s, executor = e.scheduler, e.executor
    batch = s.schedule()
    assert batch.num_steps == 8
    executor.submit(batch, [s.requests[r.request_id] for r in batch.requests])
    e.abort_request(a.request_id)  # arrives while the run is under way: it takes effect at the check-in
    updated = s.update(*executor.collect())
    assert updated == [b] and len(b.output_token_ids) == 9
    assert len(a.output_token_ids) == 1 and a.finish_reason == "abort"
    while e.has_unfinished():
        e.step()
    assert b.output_token_ids == run(engine(tiny, 1), PROMPTS[1:2], params)[0].output_token_ids
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_preemption_keeps_the_tokens(tiny):
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    want = [r.output_token_ids for r in run(engine(tiny, 1), PROMPTS[:3], params)]
    # Few blocks: the requests preempt one another, and runs take fewer steps where slots are short.
    block_bytes = kv_bytes_per_block(tiny.shape, 4, getattr(torch, CPU_AUTO_KV_DTYPE), tiny.shape.num_layers)
    e = engine(tiny, 8, block_size=4, kv_cache_memory=block_bytes * 12)
    assert e.scheduler.kv.num_blocks == 12
    got = [r.output_token_ids for r in run(e, PROMPTS[:3], params)]
    assert e.scheduler.num_preemptions > 0
    assert got == want


def test_stop_strings_cut_chunks_of_several_tokens_where_single_tokens_cut(tiny, tokenizer):
    """The gateway's detokenizer sees a run's tokens as one chunk: the text it keeps is the same (the tiny model's
    tokens read with the bundled model's tokenizer, whose vocabulary it shares)."""
    tok = tokenizer
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    def chunks(k):
        e = engine(tiny, k)
        req = e.add_request(PROMPTS[0], params)
        out, seen = [], 0
        while e.has_unfinished():
            e.step()
            if len(req.output_token_ids) > seen:
                out.append(req.output_token_ids[seen:])
                seen = len(req.output_token_ids)
        return out

    single, several = chunks(1), chunks(8)
    assert max(map(len, several)) == 8
    text = tok.decode([t for part in single for t in part])
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # lands inside a run of 8

    def cut(parts):
        d = IncrementalDetokenizer(tok, stop=[stop])
        out = "".join(d.push(p) for p in parts) + d.flush()
        return out, d.num_tokens, d.stopped

    assert cut(several) == cut(single)
    assert cut(single)[2] and cut(single)[0] == text[: text.index(stop)]


# ------------------------------------------------------------------------------ the scheduler's choice, on integers


def scheduler(num_blocks=256, policy=None, **cfg) -> Scheduler:
    config = EngineConfig(block_size=4, max_num_batched_tokens=256, check_in_steps=8, **cfg)
    return Scheduler(config, num_blocks, max_model_len=1024, policy=policy)


def test_requests_predicted_short_are_checked_every_step():
    s = scheduler(policy=Predicted(ByHidden()), scheduling_policy="predicted")
    decode_ready(s, {"long": 500, "long2": 300})
    assert s.schedule().num_steps == 8
    s = scheduler(policy=Predicted(ByHidden()), scheduling_policy="predicted")
    decode_ready(s, {"long": 500, "short": 10})
    assert s.schedule().num_steps == 1


def test_a_prompt_in_the_batch_keeps_single_steps():
    s = scheduler()
    decode_ready(s, {"a": 100})
    s.add(Request("b", [3, 3, 3], SamplingParams(max_tokens=5)))
    batch = s.schedule()
    assert batch.num_steps == 1  # b's prompt is in it
    s.update(batch, {r.request_id: SampledTokens([7]) for r in batch.requests})
    assert s.schedule().num_steps == 8


def test_slots_are_reserved_for_the_steps_each_request_can_take_and_fewer_steps_where_blocks_are_short():
    s = scheduler(num_blocks=4)  # 16 slots
    decode_ready(s, {"a": 100, "b": 3})  # 4 prompt tokens computed and one output each; the next takes a second block
    a, b = s.requests["a"], s.requests["b"]
    batch = s.schedule()
    # b can take 2 more tokens (max_tokens 3): its 2 blocks hold them; a gets the steps its 2 blocks hold, not 8.
    assert batch.num_steps == 4 and len(a.block_table) == 2 and len(b.block_table) == 2
    # The run's reserved blocks go with it, after those the runners hold (the persistent batch).
    assert [(r.block_offset, r.block_table) for r in batch.requests] == [(1, a.block_table[1:]), (1, b.block_table[1:])]
    s.update(batch, {"a": SampledTokens([7, 7, 7, 7]), "b": SampledTokens([7, 7])})
    assert b.finish_reason == "length" and s.kv.num_free_blocks == 2
    assert a.num_computed_tokens == 8 and len(a.output_token_ids) == 5
