"""Sliding-window attention on every layer: a request gives back the KV blocks wholly before its window as it moves
on, so the KV it holds stays bounded by the window however long it runs; the engine's tokens are unchanged by it."""

from engine import LLM, SamplingParams
from engine.core.config import EngineConfig, ModelShape
from engine.core.request import Request, SampledTokens
from engine.core.scheduler import Scheduler

BS = 4


def test_blocks_before_the_window_go_back_and_the_rest_are_freed_at_the_end():
    s = Scheduler(EngineConfig(block_size=BS, max_num_batched_tokens=8), 64, max_model_len=1024, kv_window=8)
    a = Request("a", list(range(100, 130)), SamplingParams(max_tokens=40), eos_token_id=0)
    s.add(a)
    held = []
    while s.has_unfinished():
        batch = s.schedule()
        s.update(batch, {r.request_id: SampledTokens([7]) for r in batch.requests if r.sample})
        held.append(s.kv.num_used_blocks)
        if a.block_table:
            # Every key a later query sees (from num_computed - 7 on) is in a block still held.
            first = a.num_computed_tokens - 8 + 1
            assert a.num_released_blocks <= max(0, first) // BS
    # The window (8), the chunk in flight (8) and partial blocks at both ends: at most 6 blocks of 4.
    assert max(held) <= 6 and len(held) > 20
    assert s.kv.num_free_blocks == 64 and all(n == 0 for n in s.kv.ref_counts)


def test_a_released_block_serves_others_and_preemption_frees_only_what_is_held():
    s = Scheduler(EngineConfig(block_size=BS, max_num_batched_tokens=64), 12, max_model_len=1024, kv_window=4)
    reqs = [
        Request(r, [hash(r) % 1000 + i for i in range(20)], SamplingParams(max_tokens=30), eos_token_id=0)
        for r in "abc"
    ]
    for r in reqs:
        s.add(r)
    while s.has_unfinished():
        batch = s.schedule()
        s.update(batch, {r.request_id: SampledTokens([7]) for r in batch.requests if r.sample})
        assert s.kv.num_used_blocks <= 12
        assert all(n >= 0 for n in s.kv.ref_counts)
    assert all(len(r.output_token_ids) == 30 for r in reqs)  # three 50-token requests in 12 blocks of 4
    assert s.kv.num_free_blocks == 12 and all(n == 0 for n in s.kv.ref_counts)


def test_a_window_longer_than_what_is_computed_releases_nothing():
    s = Scheduler(EngineConfig(block_size=BS, max_num_batched_tokens=64), 16, max_model_len=1024, kv_window=32)
    a = Request("a", list(range(100, 120)), SamplingParams(max_tokens=4), eos_token_id=0)
    s.add(a)
    batch = s.schedule()
    s.update(batch, {"a": SampledTokens([7])})  # 20 computed: the next query sees from -11 on
    assert a.num_released_blocks == 0 and s.kv.num_used_blocks == 5 and s.kv.ref_counts.count(1) == 5


def test_the_shape_knows_when_every_layer_is_windowed():
    assert ModelShape(num_layers=2, sliding_window=16).kv_window == 16
    assert ModelShape(num_layers=2, sliding_window=16, sliding_layers=(True, False)).kv_window is None
    assert ModelShape(num_layers=2).kv_window is None


SHAPE = ModelShape(
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    max_position=512,
    sliding_window=24,
)


def run_windowed(poison: bool, release: bool = True):
    """A dummy model whose layers all see 24 keys: three 150-token runs with tiny blocks and a 16-token budget.
    `poison` fills every block with NaNs as it is given back, so a read of one would show in the tokens."""
    from engine.core import config

    config.DUMMY_SHAPES["test-window"] = SHAPE
    try:
        engine = LLM(model="dummy:test-window", dtype="float32", block_size=4, max_num_batched_tokens=16).engine
    finally:
        del config.DUMMY_SHAPES["test-window"]
    kv, caches = engine.scheduler.kv, engine.runner.kv_caches
    release_before = kv.release_before

    def releasing(req, position):
        gone = req.block_table[req.num_released_blocks : max(0, position) // 4]
        if release:
            release_before(req, position)
        for cache in caches if poison else ():
            cache[:, :, gone] = float("nan")

    kv.release_before = releasing
    params = SamplingParams(max_tokens=150, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(list(range(1 + i, 60 + 7 * i)), params) for i in range(3)]
    held = []
    while engine.has_unfinished():
        engine.step()
        held.append(kv.num_used_blocks)
    assert kv.num_free_blocks == kv.num_blocks
    return [r.output_token_ids for r in reqs], held, engine


def test_a_long_windowed_run_holds_about_its_window_and_never_reads_what_it_gave_back():
    tokens, held, engine = run_windowed(poison=True)
    kept, _, _ = run_windowed(poison=False, release=False)
    assert tokens == kept  # the released blocks, NaN-filled, were never read
    assert max(held) <= 3 * ((24 + 16) // 4 + 2)  # three requests, never their 209 tokens' 53 blocks each
    assert engine.limits.max_held_tokens == 24 + 16 + 8
