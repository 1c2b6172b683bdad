"""The CUDA graph runner: buckets, padding, and segment plumbing (CPU stand-in), plus graphs vs eager on a GPU."""

import pytest
import torch
from conftest import run_staggered
from test_prompt_tiles import TilingTorchAttention

from engine import SamplingParams
from engine.core.config import EngineConfig
from engine.launch import build_engine
from engine.runner.cuda_graphs import CudaGraphRunner, bucket_for, graph_buckets
from engine.runner.decode_graphs import DecodeGraphRunner
from engine.runner.model_runner import graph_max_tokens

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village, there lived an old clockmaker who",
    "1, 2, 3, 4, 5,",
    "Q: What is 12 * 12?\nA:",
    "In machine learning, a transformer is",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize(
    "max_tokens, expected",
    [
        (1, [1]),
        (2, [1, 2]),
        (3, [1, 2, 4]),
        (8, [1, 2, 4, 8]),
        (9, [1, 2, 4, 8, 16]),
        (20, [1, 2, 4, 8, 16, 24]),
        (64, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]),
    ],
)
def test_buckets_are_powers_of_two_to_8_then_multiples_of_8(max_tokens, expected):
    assert graph_buckets(max_tokens) == expected


def test_buckets_for_the_default_token_budget():
    buckets = graph_buckets(2048)
    assert buckets[:4] == [1, 2, 4, 8]
    assert buckets[4:67] == list(range(16, 513, 8))
    assert buckets[67:] == list(range(576, 2049, 64))  # past 512 tokens, multiples of 64
    assert len(buckets) == 91 and bucket_for(buckets, 513) == 576 and bucket_for(buckets, 2000) == 2048


def test_bucket_for_pads_up_to_the_smallest_bucket_that_fits():
    buckets = graph_buckets(24)
    assert [bucket_for(buckets, n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 24)] == [1, 2, 4, 8, 8, 16, 16, 24, 24]
    assert bucket_for(buckets, 25) is None  # larger than every bucket: the runner goes eager


def test_no_buckets_below_one_token():
    with pytest.raises(ValueError):
        graph_buckets(0)


@pytest.fixture(scope="module")
def engines(checkpoint):
    """An eager engine and one whose runner replays (CPU stand-in) graphs up to 16 tokens, on the same weights."""
    # One token per request per step: the bucket checks count decode rows.
    config = EngineConfig(
        device="cpu",
        dtype="float32",
        kv_cache_dtype="float32",  # a GPU's cache holds the compute dtype: the stand-in's too
        max_num_batched_tokens=64,
        kv_cache_memory=64 * 737_280,
        speculative="off",
    )
    eager, graphed = build_engine(config, checkpoint), build_engine(config, checkpoint)
    r = graphed.runner
    r.graphs = CudaGraphRunner(r.model, r.kv_caches, 16, r.scratch_block, torch.device("cpu"), torch.float32)
    return eager, graphed


def test_graph_segments_reproduce_the_eager_logits_with_padding(engines, tokenizer):
    eager, graphed = engines
    graphs = graphed.runner.graphs
    graphs.input_ids.random_(0, 1000)  # stale padding rows must not leak into the real ones
    graphs.positions.random_(0, 100)
    prompts = [tokenizer.encode(p)[:n] for p, n in zip(PROMPTS, (4, 4, 3))]  # 11 tokens: padded to 16
    logits = []
    for engine in (eager, graphed):
        for ids in prompts:
            engine.add_request(ids, SamplingParams(max_tokens=1))
        batch = engine.scheduler.schedule()
        assert batch.num_tokens == 11
        logits.append(engine.runner.run(batch))
        for r in batch.requests:
            engine.abort_request(r.request_id)
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)


def test_piecewise_padding_rows_write_only_the_scratch_block(engines, tokenizer):
    """11 tokens replay bucket 16; its 5 padding rows were left pointing at another block by an earlier, larger
    batch: the segments write their K/V (the pre-attention halves write the cache) into the scratch block only."""
    _, graphed = engines
    graphs, bs = graphed.runner.graphs, graphed.config.block_size
    other = graphed.runner.scratch_block - 1  # a block these prompts never get
    graphs.slot_mapping.copy_(other * bs + torch.arange(len(graphs.slot_mapping)) % bs)
    caches = graphed.runner.kv_caches
    for c in caches:
        c[:, :, other] = 7.0
        c[:, :, graphed.runner.scratch_block] = 7.0
    reqs = [
        graphed.add_request(tokenizer.encode(p)[:n], SamplingParams(max_tokens=1)) for p, n in zip(PROMPTS, (4, 4, 3))
    ]
    batch = graphed.scheduler.schedule()
    graphed.runner.run(batch)
    for r in reqs:
        graphed.abort_request(r.request_id)
    assert all((c[:, :, other] == 7.0).all() for c in caches), "a padding row wrote into another block"
    assert all((c[:, :, graphed.runner.scratch_block, 0] != 7.0).all() for c in caches)
    assert graphs.slot_mapping[11:16].tolist() == [graphed.runner.scratch_block * bs] * 5


def test_greedy_tokens_identical_with_graphs_on_mixed_batches(engines, tokenizer):
    """Staggered arrivals: prefills (eager, over 16 tokens) and decodes (graph buckets) mix in iterations."""
    eager, graphed = engines
    used_buckets = []
    forward = graphed.runner.graphs.forward

    def spy(input_ids, *args):
        out = forward(input_ids, *args)
        used_buckets.append(graphed.runner.graphs.bucket_for(input_ids.shape[0]) if out is not None else None)
        return out

    graphed.runner.graphs.forward = spy
    try:
        outputs = []
        for engine in (eager, graphed):
            requests = run_staggered(engine, [tokenizer.encode(p) for p in PROMPTS], GREEDY)
            outputs.append([r.output_token_ids for r in requests])
    finally:
        del graphed.runner.graphs.forward
    assert outputs[1] == outputs[0]
    assert None in used_buckets  # long prefills ran eager
    assert {1, 2, 4, 8} <= set(used_buckets)  # decodes of 1..6 requests replayed padded buckets


def test_default_buckets_cover_the_token_budget():
    """Mixed iterations past the largest bucket run eagerly: on a GPU that halved served throughput."""
    assert graph_max_tokens(EngineConfig(max_num_batched_tokens=2048)) == 2048
    assert graph_max_tokens(EngineConfig(max_num_batched_tokens=256)) == 256
    assert graph_max_tokens(EngineConfig(max_num_batched_tokens=2048, cuda_graph_max_tokens=512)) == 512


def test_every_bucket_shares_one_set_of_static_buffers(engines):
    """Buckets replay into views of the same buffers: memory for the largest bucket only, not one set per bucket."""
    graphs = engines[1].runner.graphs
    assert set(graphs.replays) == set(graphs.buckets)
    assert all(len(r) == len(graphs.model.layers) + 1 for r in graphs.replays.values())
    largest = graphs.buckets[-1]
    assert [t.shape[0] for t in (graphs.x, graphs.q, graphs.attn_out, graphs.slot_mapping)] == [largest] * 4


# ---------------------------------------------------------------- whole-iteration decode graphs (CPU stand-in)


@pytest.fixture(scope="module")
def decode_engines(checkpoint):
    """An eager engine and one whose steps replay whole-model graphs (CPU stand-in) of up to 32 rows."""
    config = EngineConfig(
        device="cpu",
        dtype="float32",
        kv_cache_dtype="float32",  # a GPU's cache holds the compute dtype: the stand-in's too
        max_num_seqs=8,
        max_num_batched_tokens=64,
        kv_cache_memory=64 * 737_280,
        max_model_len=256,
    )
    eager, graphed = build_engine(config, checkpoint), build_engine(config, checkpoint)
    r = graphed.runner
    r.decode_graphs = DecodeGraphRunner(
        r.model, r.kv_caches, r.attention, 8, r.scratch_block, torch.device("cpu"), max_rows=32
    )
    return eager, graphed


def test_decode_graphs_give_the_eager_tokens_as_batches_grow_and_shrink(decode_engines, tokenizer):
    """Staggered arrivals and finishes: buckets 1..32 replay, for decodes and for prompts joining them (each prompt row
    a decode query against its own position); padded rows must never touch a live request's KV."""
    eager, graphed = decode_engines
    graphs = graphed.runner.decode_graphs
    used, mixed = [], []
    forward = graphs.forward

    def spy(input_ids, positions, meta, *args):
        out = forward(input_ids, positions, meta, *args)
        used.append(graphs.bucket_for(input_ids.shape[0]))
        mixed.append(out is not None and input_ids.shape[0] > meta.num_requests)
        return out

    graphs.forward = spy
    prompts = [tokenizer.encode(p) for p in PROMPTS] + [tokenizer.encode(p)[:3] for p in PROMPTS[:3]]
    params = [SamplingParams(max_tokens=8 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(len(prompts))]
    try:
        outputs = []
        for engine in (eager, graphed):
            pending, requests = list(zip(prompts, params)), []
            while pending or engine.has_unfinished():
                if pending:
                    requests.append(engine.add_request(*pending.pop(0)))
                engine.step()
            assert engine.scheduler.kv.num_free_blocks == engine.scheduler.kv.num_blocks
            outputs.append([r.output_token_ids for r in requests])
    finally:
        del graphs.forward
    assert outputs[1] == outputs[0]
    assert {1, 2, 4, 8} <= set(used)
    assert any(mixed), "no step with a prompt chunk replayed a whole-step graph"
    assert graphed.runner.scratch_block == graphed.scheduler.kv.num_blocks  # beyond every block it hands out


def test_decode_graph_padding_rows_write_only_the_scratch_block(decode_engines, tokenizer):
    """3 decoding requests replay bucket 4. The 4th row was left pointing at a live request's first slot by an
    earlier larger batch, and a sampled row past the bucket: it must be redirected to the scratch block, the stale
    row must not be read, and the real rows' logits equal eager ones."""
    eager, graphed = decode_engines
    graphs, bs = graphed.runner.decode_graphs, graphed.config.block_size
    logits = []
    for engine in (eager, graphed):
        reqs = [engine.add_request(tokenizer.encode(p), SamplingParams(max_tokens=4)) for p in PROMPTS[:3]]
        engine.step()  # the prefills
        batch = engine.scheduler.schedule()
        assert batch.num_tokens == 3
        if engine is graphed:
            victim = reqs[0].block_table[0] * bs
            graphs.slot_mapping[3:].fill_(victim)
            graphs.logit_rows.fill_(31)  # as a 32-row step would leave its last sampling row: not a row of bucket 4
            before = [c.view(2, c.shape[1], -1, c.shape[-1])[:, :, victim].clone() for c in engine.runner.kv_caches]
        logits.append(engine.runner.run(batch))
        for r in reqs:
            engine.abort_request(r.request_id)
    after = [c.view(2, c.shape[1], -1, c.shape[-1])[:, :, victim] for c in graphed.runner.kv_caches]
    assert all(torch.equal(x, y) for x, y in zip(before, after)), "a padding row wrote into a live request's KV"
    assert graphs.slot_mapping[3].item() == graphed.runner.scratch_block * bs
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)


def test_whole_step_graphs_take_chunks_after_a_cached_prefix(decode_engines, tokenizer):
    """Prompts sharing a 3-block prefix (the later ones start their chunk after cached blocks) and one longer than the
    32-row buckets (chunked by the 64-token budget: piecewise, then whole-step) arrive while others decode: every
    prompt row reads its own request's keys up to its own position, so the tokens are the eager ones."""
    eager, graphed = decode_engines
    graphs = graphed.runner.decode_graphs
    starts = []
    forward = graphs.forward

    def spy(input_ids, positions, meta, *args):
        out = forward(input_ids, positions, meta, *args)
        if out is not None:
            starts.extend(c - n for n, c in zip(meta.query_lens_cpu, meta.context_lens_cpu) if n > 1)
        return out

    graphs.forward = spy
    shared = tokenizer.encode(" ".join(PROMPTS))[:48]
    prompts = [shared + tokenizer.encode(p)[: 5 + 3 * i] for i, p in enumerate(PROMPTS[:3])]
    prompts.append(tokenizer.encode(" ".join(PROMPTS * 2))[:90])
    try:
        outputs = []
        for engine in (eager, graphed):
            pending, requests = list(prompts), []
            while pending or engine.has_unfinished():
                if pending:
                    requests.append(engine.add_request(pending.pop(0), GREEDY))
                engine.step()
            outputs.append([r.output_token_ids for r in requests])
    finally:
        del graphs.forward
    assert outputs[1] == outputs[0]
    assert any(s >= 48 for s in starts), starts  # a chunk after the cached prefix replayed a whole-step graph


def test_whole_step_graphs_give_prompt_rows_to_a_tiling_backend(decode_engines, tokenizer):
    """With a backend that tiles prompt rows (the kernel's algorithm emulated), prompts join decoding requests (two after
    a cached prefix): each prompt row is attended by its tile (a row the tiles missed stays NaN, a stale tile from a
    bigger step would overwrite a live row), decode rows by the decode path, and the tokens are the eager ones."""
    eager, graphed = decode_engines
    r = graphed.runner
    tiled = DecodeGraphRunner(
        r.model, r.kv_caches, TilingTorchAttention(), 8, r.scratch_block, torch.device("cpu"), max_rows=16
    )
    assert tiled.tile_rows == 4 and set(tiled.tiled_replays) == set(tiled.buckets) - {1}
    shared = tokenizer.encode(" ".join(PROMPTS))[:20]
    prompts = [tokenizer.encode(p) for p in PROMPTS[:4]] + [shared + tokenizer.encode(p)[:4] for p in PROMPTS[:2]]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    before, r.decode_graphs = r.decode_graphs, tiled
    try:
        outputs = []
        for engine in (eager, graphed):
            pending, requests = list(prompts), []
            while pending or engine.has_unfinished():
                if pending:
                    requests.append(engine.add_request(pending.pop(0), params))
                engine.step()
            outputs.append([r.output_token_ids for r in requests])
    finally:
        r.decode_graphs = before
    assert outputs[1] == outputs[0]
    assert tiled.attention.tiles_seen > 0


def test_torch_forward_decode_matches_forward_over_wider_tables():
    """The graph-safe path reads device lengths over the full table width; the result is the eager one."""
    from engine.attention.backend import AttentionMetadata
    from engine.attention.torch_backend import TorchAttention

    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 2, 12, 4, 8, generator=gen)
    q = torch.randn(3, 6, 8, generator=gen)
    lens = [5, 1, 9]
    tables = torch.tensor([[3, 7, 0, 0], [11, 0, 0, 0], [1, 2, 4, 0]], dtype=torch.int32)
    meta = AttentionMetadata(
        torch.arange(4, dtype=torch.int32),
        torch.tensor(lens, dtype=torch.int32),
        tables,
        torch.tensor([7 * 4, 11 * 4, 4 * 4]),
        [1, 1, 1],
        lens,
    )  # positions 4, 0, 8
    want = TorchAttention().forward(q, cache, meta)
    got = TorchAttention().forward_decode(q, cache, meta)
    torch.testing.assert_close(got, want)


@pytest.mark.gpu
def test_cuda_graphs_match_eager_on_gpu():
    base = EngineConfig(model="dummy:smollm2-135m", device="cuda", max_num_batched_tokens=256, kv_cache_memory=2**30)
    from engine.model.loader import load_checkpoint

    ckpt = load_checkpoint(base.model)
    outputs = []
    for enforce_eager in (True, False):
        engine = build_engine(base.with_(enforce_eager=enforce_eager), ckpt)
        assert (engine.runner.graphs is None) == enforce_eager
        assert (engine.runner.decode_graphs is None) == enforce_eager  # the CuPy kernel is graph-safe
        reqs = [engine.add_request(list(range(5 + 7 * i, 40 + 9 * i)), GREEDY) for i in range(8)]
        while engine.has_unfinished():
            engine.step()
        outputs.append([r.output_token_ids for r in reqs])
        del engine
        torch.cuda.empty_cache()
    # Replays run GEMMs at the bucket's row count and eager at the real one: cuBLAS may pick other kernels,
    # so bf16 rounding can flip a near-tied greedy choice of random weights. Most sequences must agree whole.
    same = sum(a == b for a, b in zip(*outputs))
    assert same >= len(outputs[0]) - 1, outputs
