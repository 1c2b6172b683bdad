"""Automatic prefix caching: which blocks a request finds, reference counts and pools that always add up,
eviction, and greedy tokens identical with and without it on the real model."""

import pytest
from conftest import PROMPTS

from engine import LLM, SamplingParams
from engine.core.config import EngineConfig
from engine.core.kv_cache import KVCacheManager, chain_hash, salt_root
from engine.core.request import Request, RequestOptions, SampledTokens
from engine.core.scheduler import Scheduler

BS = 4


def make(num_blocks=32, **cfg) -> Scheduler:
    return Scheduler(EngineConfig(block_size=BS, **{"max_num_batched_tokens": 256, **cfg}), num_blocks, 1024)


def req(rid, prompt, max_tokens=2) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens), eos_token_id=0)


def step(s: Scheduler, token=7):
    batch = s.schedule()
    s.update(batch, {r.request_id: SampledTokens([token]) for r in batch.requests if r.sample})
    check_pools(s.kv)
    return {r.request_id: len(r.token_ids) for r in batch.requests}


def check_pools(kv: KVCacheManager) -> None:
    """Every block is either held (ref > 0) or in the free queue, never both; names map both ways."""
    held = {b for b, n in enumerate(kv.ref_counts) if n > 0}
    assert all(n >= 0 for n in kv.ref_counts)
    assert held.isdisjoint(kv.free_queue) and len(held) + kv.num_free_blocks == kv.num_blocks
    assert {b: n for n, b in kv.cached.items()} == kv.block_names


def run_all(s: Scheduler):
    while s.has_unfinished():
        step(s)


@pytest.mark.parametrize("shared, hit", [(0, 0), (BS - 1, 0), (BS, BS), (BS + 1, BS), (27, 24)])
def test_a_request_takes_the_full_blocks_of_the_prefix_it_shares(shared, hit):
    s = make()
    first = list(range(100, 140))
    s.add(req("a", first))
    run_all(s)
    second = first[:shared] + list(range(500, 510))
    s.add(req("b", second))
    assert step(s) == {"b": len(second) - hit}
    assert s.prefix_hit_tokens == hit and s.prefix_queried_tokens == len(first) + len(second)


def test_the_same_prompt_again_computes_only_its_last_block():
    s = make()
    for prompt_len, computed in ((10, 2), (12, BS)):  # a whole last block is recomputed: its last token samples
        prompt = list(range(prompt_len))
        s.add(req(f"a{prompt_len}", prompt))
        run_all(s)
        s.add(req(f"b{prompt_len}", prompt))
        assert step(s) == {f"b{prompt_len}": computed}
        run_all(s)


def test_shared_blocks_are_counted_once_per_holder_and_freed_by_the_last():
    s = make(num_blocks=16)
    prompt = list(range(200, 213))  # 3 full blocks + 1 token
    s.add(req("a", prompt, max_tokens=4))
    step(s)
    s.add(req("b", prompt, max_tokens=1))
    step(s)  # b takes a's 3 full blocks
    a, b = s.requests["a"], s.requests.get("b")
    assert b is None  # b finished after its first token ...
    shared = a.block_table[:3]
    assert all(s.kv.ref_counts[blk] == 1 for blk in shared)  # ... and gave its references back
    s.add(req("c", prompt, max_tokens=3))
    step(s)
    c = s.requests["c"]
    assert c.block_table[:3] == shared and all(s.kv.ref_counts[blk] == 2 for blk in shared)
    run_all(s)
    assert s.kv.num_free_blocks == 16 and s.kv.num_cached_blocks > 0  # all free, the contents still findable


def test_cached_blocks_are_evicted_when_blocks_run_out():
    s = make(num_blocks=6)
    a = req("a", list(range(300, 316)))  # 4 full blocks, cached once computed; its 17th token opens a 5th
    s.add(a)
    run_all(s)
    assert s.kv.num_cached_blocks == 4 and s.kv.num_free_blocks == 6
    s.add(req("b", list(range(600, 620))))  # 5 blocks, none shared
    assert step(s) == {"b": 20}
    # b took the 2 blocks holding nothing findable first, then evicted the 3 cached blocks freed longest ago.
    assert sum(name in s.kv.cached for name in a.block_names) == 1
    assert s.kv.num_cached_blocks == 1 + 5  # and b's own 5 full blocks are findable now
    run_all(s)
    assert s.kv.num_free_blocks == 6


def test_abort_and_preemption_keep_finished_work_findable():
    s = make(num_blocks=32)
    prompt = list(range(700, 720))
    s.add(req("a", prompt, max_tokens=50))
    step(s)
    s.abort("a")
    assert s.kv.num_free_blocks == 32
    s.add(req("b", prompt))
    assert step(s) == {"b": 20 - 16}  # a's 4 full blocks outlived it (the 5th holds its last token)


def test_choices_of_one_prompt_share_its_blocks():
    """n > 1 reaches the engine as n requests with one prompt: the first computes it, the others wait for
    its full blocks to be computed rather than compute them again, then take them from the cache."""
    s = make()
    prompt = list(range(100, 118))  # 4 full blocks and 2 tokens
    for i in range(3):
        s.add(req(f"c{i}", prompt, max_tokens=4))
    assert step(s) == {"c0": 18}
    assert step(s) == {"c0": 1, "c1": 2, "c2": 2}  # the siblings compute only the last, partial block
    tables = [s.requests[f"c{i}"].block_table for i in range(3)]
    assert tables[0][:4] == tables[1][:4] == tables[2][:4]
    assert all(s.kv.ref_counts[b] == 3 for b in tables[0][:4])
    assert s.prefix_hit_tokens == 2 * 16
    run_all(s)
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_only_requests_with_the_same_cache_salt_share_blocks():
    """The salt is the first block's parent: another salt (or none) finds nothing of a salted prompt, the same salt
    finds all of it, and a salted first block never takes an unsalted block's name."""
    s = make()
    prompt = list(range(300, 320))  # 5 full blocks; 4 can be found (the last token is always computed)

    def hit(rid, salt):
        before = s.prefix_hit_tokens
        s.add(Request(rid, list(prompt), SamplingParams(max_tokens=2), eos_token_id=0, options=RequestOptions(salt)))
        run_all(s)
        return s.prefix_hit_tokens - before

    assert hit("a", b"tenant-a") == 0
    assert hit("b", b"tenant-b") == 0 and hit("none", b"") == 0
    assert hit("a2", b"tenant-a") == 16 and hit("b2", b"tenant-b") == 16 and hit("none2", b"") == 16
    assert len(s.kv.cached) == 3 * 5
    assert salt_root(b"") == b"" and len(salt_root(b"x")) == 33 != len(chain_hash(b"", [1]))


def test_a_request_waits_only_for_blocks_a_running_request_is_computing():
    s = make()
    s.add(req("a", list(range(100, 118))))
    s.add(req("b", list(range(100, 104)) + list(range(900, 914))))  # shares a's first block only
    s.add(req("c", list(range(500, 518))))  # shares nothing, but FCFS keeps it behind b
    assert step(s) == {"a": 18}
    assert step(s) == {"a": 1, "b": 14, "c": 18}  # b takes a's first block, computes the rest


def test_no_prefix_caching_finds_nothing():
    s = make(prefix_caching=False)
    prompt = list(range(40))
    s.add(req("a", prompt))
    run_all(s)
    s.add(req("b", prompt))
    assert step(s) == {"b": 40} and s.prefix_hit_tokens == 0 and s.kv.num_cached_blocks == 0


# ---------------------------------------------------------------- the real model: tokens identical


def prompts_sharing(tokenizer) -> list[list[int]]:
    """A long first prompt, then prompts sharing 0, 15, 16, 17 and 100+ of its tokens (16-token blocks)."""
    base = tokenizer.encode(" ".join(PROMPTS) * 2)[:140]
    assert len(base) == 140
    tail = tokenizer.encode(" and then the story took an unexpected turn")
    return [base] + [base[:n] + tail for n in (0, 15, 16, 17, 112)]


def run_in_order(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The first prompt alone (so its blocks are cached), then the others together."""
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate(prompts[:1], greedy) + llm.generate(prompts[1:], greedy)
    return [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(checkpoint, tokenizer):
    """Greedy tokens without prefix caching, per max_tokens, computed once each."""
    llm = LLM(checkpoint=checkpoint, dtype="float32", kv_cache_dtype="float32", prefix_caching=False)
    done: dict[int, list[list[int]]] = {}

    def tokens(max_tokens: int) -> list[list[int]]:
        if max_tokens not in done:
            done[max_tokens] = run_in_order(llm, prompts_sharing(tokenizer), max_tokens)
        return done[max_tokens]

    return tokens


@pytest.mark.parametrize(
    "setting, max_tokens",
    [
        ({}, 12),
        # 13 float32 blocks, and outputs long enough that running requests must grow into blocks others hold
        ({"kv_cache_memory": 13 * 737_280}, 40),
        ({"max_num_batched_tokens": 7}, 12),  # chunked prefill
        ({"kv_policy": "orca-reserve"}, 12),  # blocks for max_tokens held from admission
    ],
)
def test_greedy_tokens_are_identical_with_prefix_caching(checkpoint, tokenizer, reference, setting, max_tokens):
    llm = LLM(checkpoint=checkpoint, dtype="float32", kv_cache_dtype="float32", **setting)
    assert run_in_order(llm, prompts_sharing(tokenizer), max_tokens) == reference(max_tokens)
    s = llm.engine.scheduler
    if "kv_cache_memory" in setting:  # the few blocks are evicted and taken back: some hits, some not
        assert s.num_preemptions > 0 and s.prefix_hit_tokens > 0
    else:
        assert s.prefix_hit_tokens >= 16 + 16 + 112 // 16 * 16  # the 16-, 17- and 112-token shares at least
    assert s.kv.num_free_blocks == s.kv.num_blocks


def test_greedy_tokens_are_identical_with_prefix_caching_over_two_pipeline_stages(tokenizer, reference):
    with LLM(model=None, dtype="float32", kv_cache_dtype="float32", pipeline_stages=2) as llm:
        assert run_in_order(llm, prompts_sharing(tokenizer), 12) == reference(12)
        assert llm.engine.scheduler.prefix_hit_tokens > 0


def test_choices_of_one_prompt_get_the_tokens_of_one_computed_alone(checkpoint, tokenizer, reference):
    """Three copies of one prompt at once (as n = 3 arrives): one computes it, the other two share its blocks."""
    prompt = prompts_sharing(tokenizer)[0]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    llm = LLM(checkpoint=checkpoint, dtype="float32", kv_cache_dtype="float32")
    outs = [o.token_ids for o in llm.generate([prompt] * 3, greedy)]
    assert outs == [reference(12)[0]] * 3
    s = llm.engine.scheduler
    assert s.prefix_hit_tokens == 2 * ((len(prompt) - 1) // 16 * 16)
    assert s.kv.num_free_blocks == s.kv.num_blocks
