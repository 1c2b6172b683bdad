"""Async scheduling: step N+1 is scheduled and submitted before step N's sampled ids reach the host; rows scheduled
ahead read those ids on the device. Tokens must equal the synchronous engine's, and every block must come back."""

import pytest
from conftest import PROMPTS

from engine import LLM, SamplingParams
from engine.core.batch import PLACEHOLDER
from engine.core.config import EngineConfig, FaultPlan
from engine.core.request import Request, RequestStatus, SampledTokens
from engine.core.scheduler import Scheduler

BS = 4
MARK = 4321  # a token id none of the prompts holds: sampling raises for a prompt with it


def make(num_blocks=64) -> Scheduler:
    config = EngineConfig(block_size=BS, max_num_batched_tokens=256, async_scheduling="on")
    return Scheduler(config, num_blocks, max_model_len=1024)


def req(rid, prompt_len=6, max_tokens=8, **params) -> Request:
    base = 1000 * (1 + sum(map(ord, rid)))
    return Request(
        rid, list(range(base, base + prompt_len)), SamplingParams(max_tokens=max_tokens, **params), eos_token_id=0
    )


def rows(batch) -> dict[str, tuple[list[int], int, bool]]:
    return {r.request_id: (r.token_ids, r.num_computed_tokens, r.sample) for r in batch.requests}


def sampled(batch, token=7) -> dict:
    return {r.request_id: SampledTokens([token]) for r in batch.requests if r.sample}


def test_a_request_is_scheduled_one_token_ahead_of_what_the_host_knows():
    s = make()
    a = req("a", prompt_len=4)
    s.add(a)
    b1 = s.schedule()
    b2 = s.schedule()
    assert rows(b2) == {"a": ([PLACEHOLDER], 4, True)}  # the token b1 samples, at position 4
    assert len(a.block_table) == 2  # position 4 opens a second block
    assert a.num_pending_outputs == 2 and a.num_scheduled_tokens == 5
    assert not s.schedule().requests  # never two tokens ahead
    s.update(b1, sampled(b1, 11))
    b3 = s.schedule()
    assert rows(b3) == {"a": ([PLACEHOLDER], 5, True)}
    s.update(b2, sampled(b2, 12))
    s.update(b3, sampled(b3, 13))
    assert a.output_token_ids == [11, 12, 13]
    assert a.num_computed_tokens == 6 and a.num_in_flight_tokens == 0 and a.num_pending_outputs == 0
    assert not s.in_flight


def test_a_stop_seen_one_step_late_drops_the_extra_token_and_frees_every_block():
    s = make(num_blocks=16)
    a, b = req("a"), req("b")
    s.add(a)
    s.add(b)
    b1 = s.schedule()
    b2 = s.schedule()
    assert set(rows(b2)) == {"a", "b"}
    s.update(b1, {"a": SampledTokens([0]), "b": SampledTokens([7])})  # eos for a
    assert a.status == RequestStatus.FINISHED_STOPPED and a.output_token_ids == [0]
    s.update(b2, sampled(b2, 9))  # a's row scheduled ahead is dropped
    assert a.output_token_ids == [0] and b.output_token_ids == [7, 9]
    s.abort("b")
    assert s.kv.num_free_blocks == 16 and not s.in_flight


def test_a_request_that_may_end_or_reads_its_outputs_waits_for_its_token():
    s = make()
    last = req("last", max_tokens=1)  # its first token is its last
    pen = req("pen", presence_penalty=0.5)  # penalties read every output
    gram = req("gram", grammar='start: "x"+')  # the matcher must see each token before the next mask
    early = req("early", min_tokens=2)  # eos is masked until 2 tokens: the count must be known
    free = req("free")
    for r in (last, pen, gram, early, free):
        s.add(r)
    first = s.schedule()
    assert rows(s.schedule()) == {"free": ([PLACEHOLDER], 6, True)}
    s.update(first, sampled(first))
    third = rows(s.schedule())  # once their tokens are known they run; "free" runs ahead again
    assert set(third) == {"pen", "gram", "early", "free"} and third["free"][0] == [PLACEHOLDER]


def test_prefill_chunks_run_ahead_without_placeholders():
    config = EngineConfig(block_size=BS, max_num_batched_tokens=4, async_scheduling="on")
    s = Scheduler(config, 64, max_model_len=1024)
    a = req("a", prompt_len=10)
    s.add(a)
    assert [rows(s.schedule())["a"] for _ in range(2)] == [
        (a.prompt_token_ids[:4], 0, False),
        (a.prompt_token_ids[4:8], 4, False),
    ]
    assert not s.schedule().requests  # two chunks in flight


# ---------------------------------------------------------------- the engine, against the synchronous one


def mixed_params(n: int) -> list[SamplingParams]:
    """Greedy ones that stop at eos, seeded random ones, logprobs, a penalty, a stop id, varied lengths."""
    out = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            out.append(SamplingParams(max_tokens=6 + i, temperature=0.0))
        elif kind == 1:
            out.append(SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=i))
        elif kind == 2:
            out.append(SamplingParams(max_tokens=8 + i, temperature=0.0, logprobs=3, ignore_eos=True))
        else:
            out.append(SamplingParams(max_tokens=12, temperature=0.0, presence_penalty=0.5, stop_token_ids=(13,)))
    return out


def run(checkpoint, prompt_ids, params, **config):
    """Staggered arrivals; returns (token ids, finish reasons, logprobs, engine)."""
    llm = LLM(checkpoint=checkpoint, dtype="float32", kv_cache_dtype="float32", max_num_seqs=8, **config)
    engine = llm.engine
    placeholders = []
    schedule = engine.scheduler.schedule

    def spy(*a, **kw):
        batch = schedule(*a, **kw)
        rows = [r.token_ids[-1] for r in batch.requests] + batch.decode.token_ids
        placeholders.append(rows.count(PLACEHOLDER))
        return batch

    engine.scheduler.schedule = spy
    pending, reqs = list(zip(prompt_ids, params)), []
    while pending or engine.has_unfinished():
        if pending:
            ids, p = pending.pop(0)
            reqs.append(engine.add_request(ids, p))
        engine.step()
    s = engine.scheduler
    assert s.kv.num_free_blocks == s.kv.num_blocks and not s.in_flight and not engine.executor.num_in_flight
    lps = [[(lp.token_id, lp.logprob) for lp in r.output_logprobs] for r in reqs]
    return [r.output_token_ids for r in reqs], [r.finish_reason for r in reqs], lps, sum(placeholders), engine


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return [tokenizer.encode(p) for p in PROMPTS]


def test_async_gives_the_synchronous_tokens(checkpoint, prompt_ids):
    params = mixed_params(len(prompt_ids))
    sync = run(checkpoint, prompt_ids, params, async_scheduling="off")
    ahead = run(checkpoint, prompt_ids, params, async_scheduling="on")
    assert ahead[:2] == sync[:2]
    # Logprobs to rounding noise: batches differ in their rows, so attention and the dense ops may sum in another order.
    assert [[t for t, _ in r] for r in ahead[2]] == [[t for t, _ in r] for r in sync[2]]
    assert [v for r in ahead[2] for _, v in r] == pytest.approx([v for r in sync[2] for _, v in r], abs=2e-3)
    assert sync[3] == 0 and ahead[3] > 50  # it really ran ahead
    assert ahead[4].max_batches_in_flight == 2 and sync[4].max_batches_in_flight == 1


def test_async_under_preemption_gives_the_synchronous_tokens(checkpoint, prompt_ids):
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * 8
    small = {"kv_cache_memory": 12 * 16 * 30 * 2 * 3 * 64 * 4, "block_size": 16}  # 12 blocks: 8 requests need 24
    sync = run(checkpoint, prompt_ids[:8], params, async_scheduling="off", **small)
    ahead = run(checkpoint, prompt_ids[:8], params, async_scheduling="on", **small)
    assert ahead[0] == sync[0]
    assert ahead[4].scheduler.num_preemptions > 0


def test_an_abort_while_two_batches_are_in_flight(checkpoint, prompt_ids):
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    reference = LLM(checkpoint=checkpoint, dtype="float32", kv_cache_dtype="float32").generate(prompt_ids[:3], greedy)
    engine = LLM(checkpoint=checkpoint, dtype="float32", kv_cache_dtype="float32", async_scheduling="on").engine
    reqs = [engine.add_request(p, greedy) for p in prompt_ids[:3]]
    engine.step()
    engine.step()
    assert engine.executor.num_in_flight == 1 and engine.scheduler.in_flight["req-1"] == 1
    engine.abort_request("req-1")
    while engine.has_unfinished():
        engine.step()
    assert [reqs[0].output_token_ids, reqs[2].output_token_ids] == [reference[0].token_ids, reference[2].token_ids]
    assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks


def test_a_request_whose_sampling_raises_fails_alone_and_seeded_survivors_draw_once(checkpoint, prompt_ids):
    """The fault is raised after the batch's generators moved: resampling request by request must restore them,
    so seeded survivors draw exactly the tokens of a fault-free run."""
    params = [SamplingParams(max_tokens=8, temperature=1.0, seed=10 + i) for i in range(4)]
    clean = LLM(checkpoint=checkpoint, dtype="float32", kv_cache_dtype="float32").generate(prompt_ids[:4], params)
    for mode in ("off", "on"):
        llm = LLM(
            checkpoint=checkpoint,
            dtype="float32",
            kv_cache_dtype="float32",
            async_scheduling=mode,
            faults=FaultPlan(sampler_token=MARK),
        )
        bad = prompt_ids[1][:3] + [MARK] + prompt_ids[1][3:]
        outs = llm.generate([prompt_ids[0], bad, *prompt_ids[2:4]], params)
        assert outs[1].finish_reason == "error"
        assert [outs[i].token_ids for i in (0, 2, 3)] == [clean[i].token_ids for i in (0, 2, 3)], mode
        s = llm.engine.scheduler
        assert s.kv.num_free_blocks == s.kv.num_blocks


def test_async_is_on_only_where_it_can_overlap(checkpoint):
    llm = LLM(checkpoint=checkpoint, dtype="float32", kv_cache_dtype="float32")
    assert llm.engine.config.async_scheduling == "off"  # the CPU: nothing runs beside the host
    with pytest.raises(ValueError, match="async scheduling"):
        LLM(checkpoint=checkpoint, dtype="float32", kv_cache_dtype="float32", async_scheduling="on", pipeline_stages=2)


@pytest.mark.gpu
def test_async_on_a_gpu_gives_the_synchronous_tokens():
    """With CUDA graphs, pinned double buffers and the host copy of the sampled ids really asynchronous (dummy
    weights: the lent GPU machine has no room for the bundled GGUF)."""
    from engine.model.loader import load_checkpoint

    ckpt = load_checkpoint("dummy:smollm2-135m")
    prompt_ids = [[100 + 7 * i + j for j in range(5 + 3 * i)] for i in range(12)]
    params = [
        SamplingParams(max_tokens=8 + i, temperature=0.0, ignore_eos=True, logprobs=2 if i % 3 else None)
        for i in range(12)
    ]
    sync = run(ckpt, prompt_ids, params, device="cuda", async_scheduling="off", kv_cache_memory=2**30)
    ahead = run(ckpt, prompt_ids, params, device="cuda", async_scheduling="on", kv_cache_memory=2**30)
    assert ahead[0] == sync[0] and ahead[1] == sync[1] and ahead[3] > 50
